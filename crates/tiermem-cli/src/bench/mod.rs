//! Benchmarks: the §4.2 array microbenchmark and the Linux-swap baseline it is compared with.

pub mod apps;
pub mod array;
pub mod cleanup;
pub mod exclusive;
pub mod linux_swap;
pub mod micro;
pub mod micro_tiermem;
