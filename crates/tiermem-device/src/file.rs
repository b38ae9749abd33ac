//! File or block device through io_uring with O_DIRECT and registered buffers.
