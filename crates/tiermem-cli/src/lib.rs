//! The library behind the `tiermem` command, split out so integration tests can drive it.

pub mod bench;
pub mod machine;
pub mod run;
pub mod sim;
pub mod trace_info;
