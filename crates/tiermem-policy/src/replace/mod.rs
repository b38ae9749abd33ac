//! Replacement policies.

mod belady;
mod clock;
mod ghosts;
mod lists;
mod lru;
mod removed;
mod seq;
mod stream_first;

pub use belady::Belady;
pub use clock::Clock;
pub use lru::Lru;
pub use seq::Seq;
pub(crate) use stream_first::Groups;
pub use stream_first::StreamFirst;
