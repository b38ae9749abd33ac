//! The DRAM device: slots are plain memory and every request is a memcpy done at submission.
//! This is the "ideal" of the Ultraswap paper (its frontswap-to-DRAM baseline).
