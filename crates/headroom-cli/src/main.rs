//! The `headroom` binary.

fn main() -> anyhow::Result<()> {
    headroom_cli::run(std::env::args_os())
}
