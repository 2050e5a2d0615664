fn main() -> anyhow::Result<()> {
    for p in lb_controller::crds::write(std::path::Path::new("deploy/crds"))? {
        println!("{}", p.display());
    }
    Ok(())
}
