use std::sync::Mutex;

use super::Ondemand;
use crate::{lock, owned, FaultInfo, PageList, Prefetcher};

/// What a prefetcher built on `ondemand` keeps besides it, and how a fault goes through it:
/// the shape `temporal` and `sibling` share.
pub trait OnTopOfOndemand: Send + std::fmt::Debug {
    /// The prefetcher's name on the command line.
    const NAME: &'static str;
    /// One fault: push page ids (of any region, [`Prefetcher::spans_regions`]) into `out`.
    /// `sequential` runs `ondemand`'s own hook for the fault into the list it is given (page
    /// indices of the faulting region).
    fn advance(&mut self, fault: &FaultInfo, out: &mut PageList, sequential: impl FnOnce(&mut PageList));
}

/// `ondemand` (or `stride`) with the table `T` on top, one lock each.
#[derive(Debug)]
pub struct WithOndemand<T> {
    sequential: Ondemand,
    state: Mutex<T>,
    name: &'static str,
}

impl<T: OnTopOfOndemand> WithOndemand<T> {
    /// `ondemand`'s largest windows, and `table`.
    pub(crate) fn with_table(table: T) -> Self {
        Self { sequential: Ondemand::new(PageList::CAPACITY as u64), state: Mutex::new(table), name: T::NAME }
    }

    /// `stride`'s largest windows (`ondemand` that also follows strided streams), and `table`;
    /// named `name`.
    pub(crate) fn with_strides_and_table(table: T, name: &'static str) -> Self {
        Self { sequential: Ondemand::with_strides(PageList::CAPACITY as u64), state: Mutex::new(table), name }
    }

    /// The table, for tests to look into.
    #[cfg(test)]
    pub(crate) fn table(&self) -> std::sync::MutexGuard<'_, T> {
        lock(&self.state)
    }
}

impl<T: OnTopOfOndemand> Prefetcher for WithOndemand<T> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        // Lock order: the table, then `ondemand`'s state, always.
        lock(&self.state).advance(fault, out, |out| self.sequential.on_fault(fault, out));
    }

    fn spans_regions(&self) -> bool {
        true
    }

    fn on_fault_mut(&mut self, fault: &FaultInfo, out: &mut PageList) {
        let Self { sequential, state, .. } = self;
        owned(state).advance(fault, out, |out| sequential.on_fault_mut(fault, out));
    }
}
