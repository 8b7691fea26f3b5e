//! `gpu-report`: the holdfast performance report. See the crate docs and `benches/README.md`.

fn main() {
    std::process::exit(holdfast_benches::main_with_args(std::env::args()));
}
