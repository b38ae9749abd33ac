//! Parsing the `key=value,key=value` option string of `tiermem_engine_new`.

use tiermem_device::DeviceSpec;
use tiermem_engine::config::parse_size;
use tiermem_engine::EngineConfig;
use tiermem_sys::{Error, ErrorKind, Result, PAGE_SIZE};

/// The keys accepted, in the order the error message lists them.
pub const KEYS: &[&str] = &[
    "limit",
    "device",
    "device_size",
    "fault_mode",
    "dirty_tracking",
    "io_mode",
    "reclaim_mode",
    "prefetch",
    "replace",
    "prefetch_governor",
    "watermark",
    "evict_watermark",
    "prefetch_room",
    "io_buffers",
    "victim_pages",
    "queue_depth",
    "reclaim_batch",
    "handler_threads",
    "handler_spin_us",
    "hot_threshold",
    "damon",
    "indirect",
];

/// An engine configuration plus the device to open for it.
#[derive(Debug, Clone)]
pub struct Options {
    /// The engine's configuration.
    pub config: EngineConfig,
    /// Which device.
    pub device: DeviceSpec,
    /// Device capacity in bytes (a whole number of pages).
    pub device_size: u64,
}

fn number<T: std::str::FromStr>(value: &str) -> Result<T> {
    value.parse().map_err(|_| Error::invalid(format!("'{value}' is not a valid number")))
}

/// Set the engine field `key` from `value`.
fn apply(config: &mut EngineConfig, key: &str, value: &str) -> Result<()> {
    match key {
        "limit" => config.limit_bytes = parse_size(value)?,
        "fault_mode" => config.fault_mode = value.parse()?,
        "dirty_tracking" => config.dirty_tracking = value.parse()?,
        "io_mode" => config.io_mode = value.parse()?,
        "reclaim_mode" => config.reclaim_mode = value.parse()?,
        "prefetch" => config.prefetch = value.to_string(),
        "replace" => config.replace = value.to_string(),
        "prefetch_governor" => config.prefetch_governor = tiermem_engine::settings::on_off(value)?,
        "watermark" => config.watermark = number(value)?,
        "evict_watermark" => config.evict_watermark = number(value)?,
        "prefetch_room" => config.prefetch_room = number(value)?,
        "io_buffers" => config.io_buffers = number(value)?,
        "victim_pages" => config.victim_pages = number(value)?,
        "queue_depth" => config.queue_depth = number(value)?,
        "reclaim_batch" => config.reclaim_batch = number(value)?,
        "handler_threads" => config.handler_threads = number(value)?,
        "handler_spin_us" => config.handler_spin_us = number(value)?,
        "hot_threshold" => config.hot_threshold = number(value)?,
        "damon" => config.damon = tiermem_engine::settings::on_off(value)?,
        "indirect" => config.indirect = tiermem_engine::settings::on_off(value)?,
        other => return Err(Error::new(ErrorKind::Internal, format!("option `{other}` is not an engine field"))),
    }
    Ok(())
}

/// Parse `text`. Every key is optional; an empty string gives the defaults. Errors name the key.
pub fn parse(text: &str) -> Result<Options> {
    let mut config = EngineConfig::default();
    let mut device = DeviceSpec::Mem;
    let mut device_size = None;
    let mut seen: Vec<&str> = Vec::new();
    // The first value found wrong with the options before it, kept to name its key if the
    // whole set is refused too (a later option may be what makes it right: io_buffers=16 after
    // a victim tier too large for the default 1024 buffers).
    // (what the check said, the error naming the option that made it say so)
    let mut refused: Vec<(String, Error)> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((key, value)) = item.split_once('=') else {
            return Err(Error::invalid(format!("option `{item}` has no value: expected key=value")));
        };
        let (key, value) = (key.trim(), value.trim());
        if !KEYS.contains(&key) {
            return Err(Error::invalid(format!("unknown option `{key}` (accepted: {})", KEYS.join(", "))));
        }
        if seen.contains(&key) {
            return Err(Error::invalid(format!("option `{key}` given twice")));
        }
        seen.push(key);
        let named = |e: Error| e.context(format_args!("option `{key}`"));
        match key {
            "device" => device = DeviceSpec::parse(value).map_err(named)?,
            "device_size" => device_size = Some(parse_size(value).map_err(named)?),
            _ => {
                // A value that does not parse is wrong whatever follows.
                let mut probe = config.clone();
                apply(&mut probe, key, value).map_err(named)?;
                if let Err(e) = probe.validate() {
                    refused.push((e.to_string(), named(e)));
                }
                config = probe;
            }
        }
    }
    if let Err(e) = config.validate() {
        // Named after the option that first made the check say what it says now: an earlier
        // refusal that a later option put right is not the problem (`victim_pages` too large
        // for the default buffers, then `io_buffers=16`, then `queue_depth=0`).
        let said = e.to_string();
        return Err(refused.into_iter().find(|(text, _)| *text == said).map_or(e, |(_, named)| named));
    }
    let page = PAGE_SIZE as u64;
    let device_size = match device_size {
        Some(0) => return Err(Error::invalid("option `device_size`: must be greater than zero")),
        Some(bytes) => bytes.checked_next_multiple_of(page),
        None => config.limit_bytes.checked_mul(4).and_then(|b| b.checked_next_multiple_of(page)),
    }
    .ok_or_else(|| Error::invalid("option `device_size`: too large"))?;
    Ok(Options { config, device, device_size })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tiermem_engine::{FaultMode, IoMode};

    #[test]
    fn defaults_and_full_strings_parse() {
        let o = parse("").unwrap();
        assert_eq!(o.device, DeviceSpec::Mem);
        assert_eq!(o.device_size, 4 * o.config.limit_bytes);
        let o = parse("limit=64MiB,device=mem,device_size=1GiB,fault_mode=thread,io_mode=hybrid,prefetch=readahead,replace=clock,watermark=0.7").unwrap();
        assert_eq!(o.config.limit_bytes, 64 << 20);
        assert_eq!(o.device_size, 1 << 30);
        assert_eq!(o.config.fault_mode, FaultMode::HandlerThread);
        assert_eq!(o.config.io_mode, IoMode::Hybrid);
        assert!(o.config.prefetch_governor);
        assert!(!parse("prefetch_governor=off").unwrap().config.prefetch_governor);
        assert!(!o.config.indirect && parse("indirect=on").unwrap().config.indirect);
        let o = parse(" limit = 1MiB , fault_mode=sigbus, io_mode=poll-only,").unwrap();
        assert_eq!(o.device_size, 4 << 20);
        assert_eq!(o.config.fault_mode, FaultMode::Sigbus);
        assert_eq!(parse("device_size=5000").unwrap().device_size, 8192);
        // Values checked together: a victim tier too large for the default 1024 I/O buffers fits
        // with 16, in either order (each was refused alone against the defaults).
        for text in ["io_buffers=16,victim_pages=1048000", "victim_pages=1048000,io_buffers=16"] {
            let o = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((o.config.io_buffers, o.config.victim_pages), (16, 1_048_000), "{text}");
        }
        let message = parse("victim_pages=1048000").unwrap_err().to_string();
        assert!(message.contains("victim_pages"), "{message}");
        // Refused at the end for another option: that one is named, not the one put right.
        let message = parse("victim_pages=1048000,io_buffers=16,queue_depth=0").unwrap_err().to_string();
        assert!(message.contains("queue_depth") && !message.contains("victim_pages"), "{message}");
    }

    #[test]
    fn errors_name_the_key() {
        for (text, needle) in [
            ("bogus=1", "bogus"),
            ("limit=banana", "limit"),
            ("device=nvme", "device"),
            ("device_size=0", "device_size"),
            ("fault_mode=magic", "fault_mode"),
            ("io_mode=fast", "io_mode"),
            ("watermark=high", "watermark"),
            ("indirect=maybe", "indirect"),
            ("watermark=1.5", "watermark"),
            ("queue_depth=-1", "queue_depth"),
            ("prefetch=oracle", "`prefetch`"),
            ("limit", "limit"),
            ("limit=1MiB,limit=2MiB", "twice"),
        ] {
            let message = parse(text).unwrap_err().to_string();
            assert!(message.contains(needle), "{text}: {message}");
        }
    }
}
