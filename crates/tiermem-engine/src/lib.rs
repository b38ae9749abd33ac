//! The paging engine.
