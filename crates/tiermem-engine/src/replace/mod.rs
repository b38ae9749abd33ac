//! Replacement policies.

mod clock;

pub use clock::Clock;
