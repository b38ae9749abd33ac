//! The library behind the `tiermem` command, split out so integration tests can drive it.

pub mod bench;
pub mod machine;
pub mod run;
pub mod sim;
pub mod trace_info;

/// Write `line` and a newline to stderr, ignoring a failure: `eprintln!` panics when stderr is
/// gone (`tiermem run ... 2>&1 | head`), and in a release build (panic = abort) that would
/// replace the program's exit status, which `tiermem run` passes on, with tiermem's abort.
pub fn say(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}
