//! The processes of the environment, in start order, and the one-time steps between them: the MariaDB data
//! directory and databases, the schema syncs, and the registration of the catalog and the test project.

use super::config::{db_url, COMPUTE_HOSTS, REGION};
use super::process::{self, Spec};
use super::Layout;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// When a service counts as started.
#[derive(Clone, Copy)]
enum Ready {
    /// Accepts TCP connections on 127.0.0.1:port.
    Port(u16),
    /// Answers HTTP on 127.0.0.1:port.
    Http(u16),
    /// Has no port (nova-conductor, -scheduler, -compute): counts as started once it survived
    /// [`SETTLE_TIME`] (a bad configuration kills it sooner); `register.py` then checks that it reported in.
    Process,
}

/// One long-running process.
struct Service {
    name: String,
    /// Services of one phase start together; a phase starts when the previous one is ready.
    phase: u8,
    ready: Ready,
    command: Command,
}

/// How long one phase may take to become ready (Python services import for 5-20 s each on 2 busy cores).
const READY_TIMEOUT: Duration = Duration::from_secs(240);
/// How long a service gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// How long a service without a port must stay alive to count as started.
const SETTLE_TIME: Duration = Duration::from_secs(8);

/// Phases: MariaDB and epmd; RabbitMQ (needs epmd); Keystone; the other APIs, conductor and scheduler; the compute
/// hosts. Between them: databases and schemas after [`PHASE_RABBITMQ`], service users and catalog after
/// [`PHASE_KEYSTONE`] (the other services authenticate with them as soon as they start).
const PHASE_RABBITMQ: u8 = 1;
const PHASE_KEYSTONE: u8 = 2;
const PHASE_APIS: u8 = 3;
const PHASE_COMPUTE: u8 = 4;

fn services(layout: &Layout) -> Vec<Service> {
    let s = &layout.state;
    let etc = layout.etc();
    let mut list = Vec::new();

    let mut mariadb = Command::new("mariadbd");
    mariadb
        .arg("--no-defaults")
        .arg("--user=root")
        .arg(format!("--datadir={}", s.join("mysql").display()))
        .arg(format!("--socket={}", mysql_socket(layout).display()))
        .arg(format!(
            "--pid-file={}",
            s.join("mysql/mariadbd.pid").display()
        ))
        .args([
            "--bind-address=127.0.0.1",
            "--port=3306",
            "--skip-name-resolve",
            "--skip-log-bin",
        ])
        .args([
            "--max-connections=1000",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_general_ci",
        ])
        // Test data: trade durability for a schema sync that is several times faster.
        .args([
            "--innodb-flush-method=nosync",
            "--innodb-flush-log-at-trx-commit=0",
            "--innodb-doublewrite=0",
        ]);
    list.push(Service {
        name: "mariadb".into(),
        phase: 0,
        ready: Ready::Port(3306),
        command: mariadb,
    });

    // Our own epmd, so that it binds 127.0.0.1 and we own its PID (RabbitMQ would otherwise daemonize one).
    let mut epmd = Command::new("epmd");
    epmd.args(["-address", "127.0.0.1", "-port", "4369"]);
    list.push(Service {
        name: "epmd".into(),
        phase: 0,
        ready: Ready::Port(4369),
        command: epmd,
    });

    // The Debian wrapper in /usr/sbin switches to the rabbitmq user; the real script runs fine as root with
    // everything pointed at our state directory.
    let rabbit_dir = s.join("rabbitmq");
    let mut rabbit = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server");
    rabbit
        .env("HOME", &rabbit_dir)
        .env(
            "RABBITMQ_CONF_ENV_FILE",
            rabbit_dir.join("rabbitmq-env.conf"),
        )
        .env("RABBITMQ_CONFIG_FILE", rabbit_dir.join("rabbitmq.conf"))
        .env(
            "RABBITMQ_ADVANCED_CONFIG_FILE",
            rabbit_dir.join("advanced.config"),
        )
        .env(
            "RABBITMQ_ENABLED_PLUGINS_FILE",
            rabbit_dir.join("enabled_plugins"),
        )
        .env("RABBITMQ_MNESIA_BASE", rabbit_dir.join("mnesia"))
        .env("RABBITMQ_LOG_BASE", layout.log_dir())
        .env("RABBITMQ_LOGS", "-")
        .env("RABBITMQ_PID_FILE", rabbit_dir.join("rabbit.pid"))
        .env("RABBITMQ_NODENAME", "rabbit@localhost")
        .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
        .env("RABBITMQ_NODE_PORT", "5672")
        .env("RABBITMQ_DIST_PORT", "25672")
        .env(
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
            "-kernel inet_dist_use_interface {127,0,0,1}",
        )
        .env("ERL_EPMD_ADDRESS", "127.0.0.1")
        .env("ERL_EPMD_PORT", "4369");
    list.push(Service {
        name: "rabbitmq".into(),
        phase: PHASE_RABBITMQ,
        ready: Ready::Port(5672),
        command: rabbit,
    });

    let wsgi = |name: &str, app: &str, port: u16, env: &[(&str, String)]| {
        let mut c = python_command(layout, layout.bin("python"));
        c.arg(layout.support.join("python/wsgi_serve.py"))
            .arg(app)
            .arg(port.to_string());
        for (k, v) in env {
            c.env(k, v);
        }
        Service {
            name: name.into(),
            phase: PHASE_APIS,
            ready: Ready::Http(port),
            command: c,
        }
    };
    let dir = |d: &str| etc.join(d).display().to_string();
    let mut keystone = wsgi(
        "keystone",
        "keystone.wsgi.api:application",
        5000,
        &[("OS_KEYSTONE_CONFIG_DIR", dir("keystone"))],
    );
    keystone.phase = PHASE_KEYSTONE;
    list.push(keystone);
    list.push(wsgi(
        "glance",
        "glance.wsgi.api:application",
        9292,
        &[("OS_GLANCE_CONFIG_DIR", dir("glance"))],
    ));
    list.push(wsgi(
        "placement",
        "placement.wsgi.api:application",
        8778,
        &[("OS_PLACEMENT_CONFIG_DIR", dir("placement"))],
    ));
    // Neutron sizes its worker pools from uWSGI or mod_wsgi; with neither importable it asks for ASGI_WORKERS.
    list.push(wsgi(
        "neutron",
        "neutron.wsgi.api:application",
        9696,
        &[
            ("OS_NEUTRON_CONFIG_DIR", dir("neutron")),
            ("ASGI_WORKERS", "1".into()),
        ],
    ));
    list.push(wsgi(
        "nova-api",
        "nova.wsgi.osapi_compute:application",
        8774,
        &[("OS_NOVA_CONFIG_DIR", dir("nova"))],
    ));

    let nova_conf = etc.join("nova/nova.conf");
    for binary in ["nova-conductor", "nova-scheduler"] {
        let mut c = python_command(layout, layout.bin(binary));
        c.arg("--config-file").arg(&nova_conf);
        list.push(Service {
            name: binary.into(),
            phase: PHASE_APIS,
            ready: Ready::Process,
            command: c,
        });
    }
    // The compute hosts start once placement and the conductor run: a compute that finds no placement at start-up
    // only retries in its 60 s periodic task.
    for n in 1..=COMPUTE_HOSTS {
        let mut c = python_command(layout, layout.bin("nova-compute"));
        c.arg("--config-file")
            .arg(&nova_conf)
            .arg("--config-file")
            .arg(etc.join(format!("nova/compute-{n}.conf")));
        list.push(Service {
            name: format!("nova-compute-{n}"),
            phase: PHASE_COMPUTE,
            ready: Ready::Process,
            command: c,
        });
    }
    list
}

/// A command of the venv with a clean OpenStack environment: a developer's `OS_CLOUD` or `OS_AUTH_URL` must not leak
/// into the services or into register.py.
fn python_command(layout: &Layout, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(program);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("OS_") {
            c.env_remove(key);
        }
    }
    c.current_dir(&layout.state).env("PYTHONUNBUFFERED", "1");
    c
}

fn mysql_socket(layout: &Layout) -> std::path::PathBuf {
    layout.run_dir().join("mysqld.sock")
}

/// Whether every service of the environment runs.
pub fn all_running(layout: &Layout) -> bool {
    services(layout)
        .iter()
        .all(|s| process::running_pid(&layout.run_dir(), &s.name).is_some())
}

/// Prints each service's state and the client files.
pub fn status(layout: &Layout) {
    for s in services(layout) {
        match process::running_pid(&layout.run_dir(), &s.name) {
            Some(pid) => println!("{:<16} running (pid {pid})", s.name),
            None => println!("{:<16} stopped", s.name),
        }
    }
    for f in ["clouds.yaml", "cloudprovider.conf", "testenv.json"] {
        let p = layout.state.join(f);
        if p.exists() {
            println!("{}", p.display());
        }
    }
}

/// Starts every service that does not run yet, phase by phase, with the one-time set-up steps in between. Returns
/// how many services it started (0: everything was running already).
pub fn start_all(layout: &Layout) -> Result<usize> {
    let mut started = 0;
    prepare_dirs(layout)?;
    let mut all = services(layout);
    let last_phase = all.iter().map(|s| s.phase).max().unwrap_or(0);
    for phase in 0..=last_phase {
        if phase == 0 {
            init_mariadb(layout)?;
        }
        let batch: Vec<Service> = {
            let (now, later) = all.into_iter().partition(|s| s.phase == phase);
            all = later;
            now
        };
        started += start_phase(layout, batch)?;
        match phase {
            PHASE_RABBITMQ => {
                create_databases(layout)?;
                sync_schemas(layout)?;
            }
            PHASE_KEYSTONE => {
                // Stamped: the catalog only changes through us, and it is slow to re-check (about 40 Keystone calls).
                let stamp = layout.stamps().join("register-identity");
                if !stamp.exists() {
                    register(layout, "identity")?;
                    std::fs::write(&stamp, "")
                        .with_context(|| format!("writing {}", stamp.display()))?;
                }
            }
            _ => {}
        }
    }
    Ok(started)
}

fn prepare_dirs(layout: &Layout) -> Result<()> {
    let s = &layout.state;
    let mut dirs = vec![
        s.join("keystone"),
        s.join("glance/images"),
        s.join("glance/staging"),
        s.join("glance/tasks"),
        s.join("glance/lock"),
        s.join("neutron/lock"),
        s.join("nova/instances"),
        s.join("nova/lock"),
        s.join("rabbitmq/mnesia"),
    ];
    for n in 1..=COMPUTE_HOSTS {
        dirs.push(s.join(format!("nova/compute-{n}/instances")));
    }
    for d in &dirs {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let rabbit = s.join("rabbitmq");
    // Only the AMQP listener, on loopback; no plugins (the management UI would open another port).
    std::fs::write(
        rabbit.join("rabbitmq.conf"),
        "listeners.tcp.default = 127.0.0.1:5672\nloopback_users.guest = true\n",
    )?;
    std::fs::write(rabbit.join("enabled_plugins"), "[].\n")?;
    std::fs::write(
        rabbit.join("rabbitmq-env.conf"),
        "# empty: everything is set in the environment\n",
    )?;
    Ok(())
}

/// Starts the services of one phase that are not running and waits until all of them are ready. Returns how many
/// it started.
fn start_phase(layout: &Layout, batch: Vec<Service>) -> Result<usize> {
    let run_dir = layout.run_dir();
    let mut pending = Vec::new();
    let mut already = Vec::new();
    for s in batch {
        if process::running_pid(&run_dir, &s.name).is_some() {
            // Already running: still check that it answers, so that a hung API fails here and not in a test.
            let long_ago = Instant::now()
                .checked_sub(SETTLE_TIME)
                .unwrap_or_else(Instant::now);
            already.push((s.name, s.ready, long_ago));
            continue;
        }
        if let Ready::Port(port) | Ready::Http(port) = s.ready {
            if process::port_open(port) {
                bail!(
                    "cannot start {}: 127.0.0.1:{port} is already in use by a process `cargo xtask openstack up` \
                     did not start (or whose PID file is gone). Stop it (e.g. `ss -ltnp 'sport = :{port}'` shows \
                     which), then run `cargo xtask openstack up` again",
                    s.name
                );
            }
        }
        eprintln!("openstack: starting {}", s.name);
        let (name, ready) = (s.name.clone(), s.ready);
        process::spawn(
            Spec {
                name: s.name,
                command: s.command,
            },
            &run_dir,
            &layout.log_dir(),
        )?;
        pending.push((name, ready, Instant::now()));
    }
    let started = pending.len();
    pending.extend(already);
    let deadline = Instant::now() + READY_TIMEOUT;
    while !pending.is_empty() {
        let mut still = Vec::new();
        for (name, ready, spawned) in pending {
            if process::running_pid(&run_dir, &name).is_none() {
                bail!("{name} exited during start-up; {}", log_hint(layout, &name));
            }
            let ok = match ready {
                Ready::Port(p) => process::port_open(p),
                Ready::Http(p) => process::http_answers(p),
                Ready::Process => spawned.elapsed() >= SETTLE_TIME,
            };
            if !ok {
                still.push((name, ready, spawned));
            }
        }
        pending = still;
        if pending.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let names: Vec<&str> = pending.iter().map(|(n, _, _)| n.as_str()).collect();
            bail!(
                "not ready after {}s: {}; see {}",
                READY_TIMEOUT.as_secs(),
                names.join(", "),
                layout.log_dir().display()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok(started)
}

fn log_hint(layout: &Layout, name: &str) -> String {
    let log = layout.log_dir().join(format!("{name}.log"));
    format!(
        "last lines of {}:\n{}",
        log.display(),
        process::log_tail(&log, 30)
    )
}

/// Creates the MariaDB data directory on first start.
fn init_mariadb(layout: &Layout) -> Result<()> {
    let datadir = layout.state.join("mysql");
    if datadir.join("mysql").is_dir() {
        return Ok(());
    }
    eprintln!("openstack: initialising the MariaDB data directory");
    let log = layout.log_dir().join("mariadb-install-db.log");
    run_logged(
        Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg("--user=root")
            .arg(format!("--datadir={}", datadir.display()))
            .args(["--auth-root-authentication-method=socket", "--skip-test-db"]),
        &log,
        "mariadb-install-db",
    )
}

/// Creates the databases and the `openstack` database user (idempotent; also resets the password).
fn create_databases(layout: &Layout) -> Result<()> {
    let pw = layout.password.replace('\\', "\\\\").replace('\'', "\\'");
    let mut sql = String::new();
    for db in [
        "keystone",
        "glance",
        "placement",
        "neutron",
        "nova_api",
        "nova_cell0",
        "nova_cell1",
    ] {
        sql += &format!("CREATE DATABASE IF NOT EXISTS {db} CHARACTER SET utf8mb4;");
    }
    sql += &format!(
        "CREATE USER IF NOT EXISTS 'openstack'@'127.0.0.1' IDENTIFIED BY '{pw}';\
         ALTER USER 'openstack'@'127.0.0.1' IDENTIFIED BY '{pw}';\
         GRANT ALL PRIVILEGES ON *.* TO 'openstack'@'127.0.0.1';"
    );
    let out = Command::new("mariadb")
        .arg("--no-defaults")
        .arg(format!("--socket={}", mysql_socket(layout).display()))
        .args(["-u", "root", "-e", &sql])
        .output()
        .context("creating the databases: could not run the mariadb client")?;
    if !out.status.success() {
        bail!(
            "creating the databases failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A one-time set-up command, with its output in a log file that the error message points to.
fn run_logged(cmd: &mut Command, log: &Path, what: &str) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let status = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("{what}: could not start {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!(
            "{what} failed ({status}); last lines of {}:\n{}",
            log.display(),
            process::log_tail(log, 30)
        );
    }
    Ok(())
}

/// Syncs every service's schema once (stamped), the five services in parallel: the syncs mostly wait on MariaDB,
/// and sequentially they take 40-60 s.
fn sync_schemas(layout: &Layout) -> Result<()> {
    let conf = |p: &str| layout.etc().join(p).display().to_string();
    // `<venv>/bin/<program> --config-file <each of confs> <args split on whitespace>`.
    let step = |program: &str, confs: &[&str], args: &str| {
        let mut c = python_command(layout, layout.bin(program));
        for f in confs {
            c.arg("--config-file").arg(conf(f));
        }
        c.args(args.split_whitespace());
        c
    };
    let keystone_conf = ["keystone/keystone.conf"];
    let owner = "--keystone-user root --keystone-group root";
    let url = format!("{}/", super::config::AUTH_URL);
    let mut bootstrap = step(
        "keystone-manage",
        &keystone_conf,
        &format!(
            "bootstrap --bootstrap-admin-url {url} --bootstrap-internal-url {url} --bootstrap-public-url {url} \
             --bootstrap-region-id {REGION}"
        ),
    );
    bootstrap.arg("--bootstrap-password").arg(&layout.password);
    let keystone = vec![
        step("keystone-manage", &keystone_conf, "db_sync"),
        step(
            "keystone-manage",
            &keystone_conf,
            &format!("fernet_setup {owner}"),
        ),
        step(
            "keystone-manage",
            &keystone_conf,
            &format!("credential_setup {owner}"),
        ),
        bootstrap,
    ];
    let glance = vec![step(
        "glance-manage",
        &["glance/glance-api.conf"],
        "db_sync",
    )];
    let placement = vec![step(
        "placement-manage",
        &["placement/placement.conf"],
        "db sync",
    )];
    let neutron_confs = ["neutron/neutron.conf", "neutron/plugins/ml2/ml2_conf.ini"];
    let neutron = vec![step("neutron-db-manage", &neutron_confs, "upgrade heads")];
    let nova_conf = ["nova/nova.conf"];
    let mut map_cell0 = step(
        "nova-manage",
        &nova_conf,
        "cell_v2 map_cell0 --database_connection",
    );
    map_cell0.arg(format!("{}/nova_cell0", db_url(layout)));
    // create_cell fails when the cell exists; a shell keeps the check and the command together.
    let mut create_cell = python_command(layout, "sh");
    create_cell
        .arg("-c")
        .arg(r#""$0" --config-file "$1" cell_v2 list_cells | grep -qw cell1 || "$0" --config-file "$1" cell_v2 create_cell --name cell1 --verbose"#)
        .arg(layout.bin("nova-manage"))
        .arg(conf(nova_conf[0]));
    let nova = vec![
        step("nova-manage", &nova_conf, "api_db sync"),
        map_cell0,
        create_cell,
        step("nova-manage", &nova_conf, "db sync"),
    ];
    let jobs = [
        ("keystone", keystone),
        ("glance", glance),
        ("placement", placement),
        ("neutron", neutron),
        ("nova", nova),
    ];
    let t = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|(name, steps)| scope.spawn(move || sync_one(layout, name, steps)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("schema sync thread panicked"))
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>>>()?;
    if t.elapsed() > Duration::from_secs(1) {
        eprintln!(
            "openstack: schemas synced in {:.1}s",
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn sync_one(layout: &Layout, name: &str, steps: Vec<Command>) -> Result<()> {
    let stamp = layout.stamps().join(format!("schema-{name}"));
    if stamp.exists() {
        return Ok(());
    }
    eprintln!("openstack: syncing the {name} schema");
    let log = layout.log_dir().join(format!("schema-{name}.log"));
    for mut step in steps {
        run_logged(&mut step, &log, &format!("{name} schema sync"))?;
    }
    std::fs::write(&stamp, "").with_context(|| format!("writing {}", stamp.display()))
}

/// Runs `register.py STEP` (idempotent). Step `identity`: service users and the catalog, needed before the other
/// services start. Step `resources`: test project and user, flavor, image, networks, and the compute hosts mapped
/// into cell1. Returns the JSON object it prints.
pub fn register(layout: &Layout, step: &str) -> Result<serde_json::Value> {
    let t = Instant::now();
    let nova_manage = serde_json::json!([
        layout.bin("nova-manage"),
        "--config-file",
        layout.etc().join("nova/nova.conf"),
    ]);
    let out = python_command(layout, layout.bin("python"))
        .arg(layout.support.join("python/register.py"))
        .arg(step)
        .env("LBTEST_PASSWORD", &layout.password)
        .env("LBTEST_STATE_DIR", &layout.state)
        .env("LBTEST_NOVA_MANAGE", nova_manage.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("registering the catalog and the test project: could not run register.py")?;
    if !out.status.success() {
        let dead: Vec<String> = services(layout)
            .into_iter()
            .filter(|s| process::running_pid(&layout.run_dir(), &s.name).is_none())
            .map(|s| format!("{} is not running; {}", s.name, log_hint(layout, &s.name)))
            .collect();
        bail!(
            "register.py failed ({}); its messages are above, the service logs in {}\n{}",
            out.status,
            layout.log_dir().display(),
            dead.join("\n")
        );
    }
    eprintln!(
        "openstack: register.py {step} done in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "register.py printed no JSON: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Stops every recorded process: the OpenStack services first (in parallel), then RabbitMQ, epmd and MariaDB, so
/// that the services do not log a storm of connection errors on their way out.
pub fn stop_all(layout: &Layout) -> Result<()> {
    let run_dir = layout.run_dir();
    let infra = ["rabbitmq", "epmd", "mariadb"];
    // Every PID file counts, including those of services a newer or older xtask may know under other names.
    let mut names: Vec<String> = std::fs::read_dir(&run_dir)
        .map(|entries| {
            entries
                .filter_map(|e| {
                    e.ok()?
                        .file_name()
                        .to_str()?
                        .strip_suffix(".pid")
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    let (infra_names, os_names): (Vec<String>, Vec<String>) =
        names.into_iter().partition(|n| infra.contains(&n.as_str()));
    let t = Instant::now();
    for wave in [os_names, infra_names] {
        let results: Vec<Result<()>> = std::thread::scope(|scope| {
            let handles: Vec<_> = wave
                .iter()
                .map(|name| {
                    let run_dir = &run_dir;
                    scope.spawn(move || process::stop(run_dir, name, STOP_GRACE))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("stop thread panicked"))
                .collect()
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
    }
    eprintln!("openstack: stopped in {:.1}s", t.elapsed().as_secs_f64());
    Ok(())
}
