//! Service configuration (rendered from `testenv/openstack/templates/`) and the client files `up` writes for tests,
//! developers and the controllers: `clouds.yaml`, a yawol-style `cloudprovider.conf` and `testenv.json`.

use super::Layout;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Keystone's public endpoint, the only URL a client needs.
pub const AUTH_URL: &str = "http://127.0.0.1:5000/v3";
/// The one region of the catalog.
pub const REGION: &str = "RegionOne";
/// Number of nova-compute hosts: two, so that a two-replica anti-affinity server group can be ACTIVE.
pub const COMPUTE_HOSTS: usize = 2;

/// The connection prefix of every service database (MariaDB on 127.0.0.1, user `openstack`).
pub fn db_url(layout: &Layout) -> String {
    format!(
        "mysql+pymysql://openstack:{}@127.0.0.1:3306",
        layout.password
    )
}

/// RabbitMQ's default `guest` user may only log in over loopback, which is all we use.
const TRANSPORT_URL: &str = "rabbit://guest:guest@127.0.0.1:5672/";

/// The `[keystone_authtoken]` section of one service.
fn authtoken(layout: &Layout, user: &str) -> String {
    format!(
        "www_authenticate_uri = http://127.0.0.1:5000\n\
         auth_url = http://127.0.0.1:5000\n\
         auth_type = password\n\
         project_domain_name = Default\n\
         user_domain_name = Default\n\
         project_name = service\n\
         username = {user}\n\
         password = {}\n\
         region_name = {REGION}",
        layout.password
    )
}

/// Replaces `@NAME@` placeholders; a placeholder left over is a template bug and fails loudly.
fn render(template: &str, vars: &[(String, String)], what: &Path) -> Result<String> {
    let mut out = template.to_string();
    for (name, value) in vars {
        out = out.replace(&format!("@{name}@"), value);
    }
    // Comments may mention the placeholder syntax (`@NAME@`); only real lines must be fully rendered.
    for line in out.lines().filter(|l| !l.trim_start().starts_with('#')) {
        if let Some(start) = line.find('@') {
            if line[start + 1..].contains('@') {
                bail!("{}: unknown placeholder in line {line:?}", what.display());
            }
        }
    }
    Ok(out)
}

/// Renders every service's configuration into `<state>/etc/` and copies the paste files the wheels ship.
/// Cheap, so done on every `up`; services already running keep the configuration they started with.
pub fn render_all(layout: &Layout) -> Result<()> {
    let templates = layout.support.join("templates");
    let state = layout.state.display().to_string();
    let mut vars: Vec<(String, String)> = vec![
        ("STATE".into(), state),
        ("DB".into(), db_url(layout)),
        ("TRANSPORT".into(), TRANSPORT_URL.into()),
        ("PASSWORD".into(), layout.password.clone()),
    ];
    for user in ["glance", "placement", "neutron", "nova"] {
        vars.push((format!("AUTHTOKEN:{user}"), authtoken(layout, user)));
    }
    let files: &[(&str, &str)] = &[
        ("keystone.conf", "keystone/keystone.conf"),
        ("glance-api.conf", "glance/glance-api.conf"),
        ("placement.conf", "placement/placement.conf"),
        ("neutron.conf", "neutron/neutron.conf"),
        ("ml2_conf.ini", "neutron/plugins/ml2/ml2_conf.ini"),
        ("nova.conf", "nova/nova.conf"),
    ];
    for (template, target) in files {
        render_file(&templates.join(template), &layout.etc().join(target), &vars)?;
    }
    for n in 1..=COMPUTE_HOSTS {
        let mut v = vars.clone();
        v.push(("N".into(), n.to_string()));
        render_file(
            &templates.join("nova-compute.conf"),
            &layout.etc().join(format!("nova/compute-{n}.conf")),
            &v,
        )?;
    }
    // The paste pipelines ship with the wheels under <venv>/etc/; the services look for them next to their config.
    for (src, dst) in [
        (
            "etc/glance/glance-api-paste.ini",
            "glance/glance-api-paste.ini",
        ),
        ("etc/neutron/api-paste.ini", "neutron/api-paste.ini"),
        ("etc/nova/api-paste.ini", "nova/api-paste.ini"),
    ] {
        let src = layout.venv.join(src);
        let dst = layout.etc().join(dst);
        std::fs::copy(&src, &dst)
            .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
    }
    Ok(())
}

fn render_file(template: &Path, target: &Path, vars: &[(String, String)]) -> Result<()> {
    let text = std::fs::read_to_string(template)
        .with_context(|| format!("reading {}", template.display()))?;
    let rendered = render(&text, vars, template)?;
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    write_private(target, &rendered)
}

/// Writes a file that contains the password readable by its owner only.
fn write_private(path: &Path, content: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(content.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes `clouds.yaml` (clouds `lbtest` and `lbtest-admin`), `cloudprovider.conf` (yawol's `[Global]` INI for the
/// test project) and `testenv.json` (what the tests need: credentials and the IDs of the pre-created resources).
/// `ids` is the JSON object `register.py` printed. Returns the paths written.
pub fn write_client_files(layout: &Layout, ids: &serde_json::Value) -> Result<Vec<PathBuf>> {
    let field = |name: &str| -> Result<String> {
        ids.get(name)
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .with_context(|| format!("register.py printed no {name:?}: {ids}"))
    };
    let project_id = field("project_id")?;
    let project_name = field("project_name")?;
    let username = field("username")?;
    let password = &layout.password;

    let cloud = |name: &str, user: &str, project: &str| {
        format!(
            "  {name}:\n    auth_type: password\n    auth:\n      auth_url: {AUTH_URL}\n      username: {user}\n      \
             password: {password}\n      project_name: {project}\n      user_domain_name: Default\n      \
             project_domain_name: Default\n    region_name: {REGION}\n    interface: public\n    \
             identity_api_version: 3\n"
        )
    };
    let clouds = format!(
        "# Written by `cargo xtask openstack up`: the OpenStack test environment on 127.0.0.1.\nclouds:\n{}{}",
        cloud("lbtest", &username, &project_name),
        cloud("lbtest-admin", "admin", "admin")
    );
    let cloudprovider = format!(
        "# Written by `cargo xtask openstack up`: yawol-style credentials for the test project.\n[Global]\n\
         auth-url = {AUTH_URL}\nusername = {username}\npassword = {password}\ndomain-name = Default\n\
         project-id = {project_id}\nproject-name = {project_name}\nregion = {REGION}\n"
    );
    let mut info = ids.clone();
    if let Some(obj) = info.as_object_mut() {
        obj.insert("auth_url".into(), AUTH_URL.into());
        obj.insert("region".into(), REGION.into());
        obj.insert("password".into(), password.as_str().into());
        obj.insert("cloud".into(), "lbtest".into());
        obj.insert("admin_cloud".into(), "lbtest-admin".into());
    }
    let info = serde_json::to_string_pretty(&info)? + "\n";

    let mut written = Vec::new();
    for (name, content) in [
        ("clouds.yaml", clouds),
        ("cloudprovider.conf", cloudprovider),
        ("testenv.json", info),
    ] {
        let path = layout.state.join(name);
        write_private(&path, &content)?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_replaces_and_rejects_unknown_placeholders() {
        let vars = vec![("A".to_string(), "1".to_string())];
        let p = Path::new("t.conf");
        assert_eq!(
            render("x = @A@\n# @NAME@ is fine in comments\n", &vars, p)
                .unwrap()
                .lines()
                .next(),
            Some("x = 1")
        );
        assert!(render("x = @B@\n", &vars, p).is_err());
        // A lone @ (e.g. in a password) is not a placeholder.
        assert!(render("p = a@b\n", &vars, p).is_ok());
    }
}
