//! `cargo xtask fuzz …`: fuzzing campaigns longer than the fixed-seed passes `cargo xtask test` runs.
//!
//! `dataplane`: the differential fuzzer of the data plane (`lb-agent/tests/differential/`), its ignored long
//! campaign with the number of frames and the seed passed through the environment; it prints frames/s, the rules
//! the frames reached and, on a difference, the shortest sequence that shows it.

use crate::{ebpf, test::workspace_cargo, util::run};
use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum FuzzCmd {
    /// Generated and corrupted frames through the real XDP and TC programs and the reference model.
    Dataplane {
        /// Frames per hook.
        #[arg(long, default_value_t = 1_000_000)]
        frames: u64,
        /// Seed of the XDP campaign (the TC one uses the next).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

pub fn run_fuzz(cmd: FuzzCmd) -> Result<()> {
    match cmd {
        FuzzCmd::Dataplane { frames, seed } => {
            ebpf::build()?;
            // The workspace selection of the test stages, so this reuses their build.
            let mut c =
                workspace_cargo(&["test", "--exclude", "lb-testbed", "--test", "differential"]);
            c.args(["--", "--ignored", "--nocapture", "campaign_from_env"])
                .env("LB_FUZZ_FRAMES", frames.to_string())
                .env("LB_FUZZ_SEED", seed.to_string());
            run(&mut c, "the data-plane differential fuzzer")
        }
    }
}
