//! Any text as an option: sizes, limits, device specs, synthetic trace names, trace formats and
//! the C API's `key=value` string are parsed or refused with an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = tiermem_engine::config::parse_size(text);
    let _ = text.parse::<tiermem_engine::config::Limit>();
    let _ = tiermem_device::DeviceSpec::parse(text);
    let _ = text.parse::<tiermem_sim::Synthetic>();
    let _ = text.parse::<tiermem_sim::Format>();
    if let Ok(options) = tiermem::options::parse(text) {
        let _ = options.config.validate();
    }
});
