//! The `tiermem` command.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tiermem_cli::bench::micro;
use tiermem_sys::{Error, ErrorKind, Result};

/// User-space paging with userfaultfd and io_uring.
#[derive(Debug, Parser)]
#[command(name = "tiermem", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a benchmark.
    Bench(BenchArgs),
    /// Internal: the child process of `bench micro --system linux-swap`.
    #[command(hide = true)]
    MicroWorker(MicroWorkerArgs),
}

#[derive(Debug, Args)]
struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The array microbenchmark: write an N MB array under an M MB memory limit, read it back.
    Micro(MicroArgs),
}

#[derive(Debug, Args)]
struct MicroArgs {
    /// Which pager to measure.
    #[arg(long, value_enum)]
    system: MicroSystem,
    /// Array size in MiB.
    #[arg(long, default_value_t = 100)]
    size_mb: u64,
    /// Memory limit in MiB (must be smaller than the array).
    #[arg(long, default_value_t = 50)]
    limit_mb: u64,
    /// Directory on the file system to page to (the swap file goes here). Default: the temp dir.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print the full result as JSON instead of the summary.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum MicroSystem {
    /// The kernel's own swap, to a swap file, under a memory cgroup limit.
    LinuxSwap,
}

#[derive(Debug, Args)]
struct MicroWorkerArgs {
    /// Array size in MiB.
    #[arg(long)]
    size_mb: u64,
}

fn bench_micro(args: &MicroArgs) -> Result<()> {
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    match args.system {
        MicroSystem::LinuxSwap => {
            micro::validate_micro_args(args.size_mb, args.limit_mb, &dir)?;
            let worker = std::env::current_exe().map_err(|e| Error::os(e, "locating the tiermem executable"))?;
            let point = micro::linux_swap_point_with_worker(args.size_mb, args.limit_mb, &dir, &worker)?;
            if args.json {
                let json = serde_json::to_string(&point).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
                println!("{json}");
            } else {
                println!("{}", micro::format_linux_swap_point(&point));
            }
        }
    }
    Ok(())
}

fn micro_worker(args: &MicroWorkerArgs) -> Result<()> {
    let result = micro::run_micro_worker(args.size_mb)?;
    let json = serde_json::to_string(&result).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    println!("{json}");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match &cli.command {
        Command::Bench(BenchArgs { command: BenchCommand::Micro(args) }) => bench_micro(args),
        Command::MicroWorker(args) => micro_worker(args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tiermem: error: {e}");
            // 2 for bad arguments, like clap's own usage errors.
            ExitCode::from(if e.kind() == ErrorKind::InvalidInput { 2 } else { 1 })
        }
    }
}
