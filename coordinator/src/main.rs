//! `pgmr`: the pg_multiregion node sidecar.
//!
//! One pgmr runs beside each PostgreSQL server. It supervises that server, carries every
//! message between nodes (which is where authentication, simulated WAN latency and, later,
//! fault injection live), and answers the extension's questions over a local Unix socket.
//! See docs/ARCHITECTURE.md for the whole design.

mod blocking;
mod cli;
mod demo;
mod failpoint;
mod gateway;
mod http;
mod identity;
mod local;
mod membership;
mod meta;
mod net;
mod node;
mod postgres;
mod range;
mod schema;
mod stats;
mod status;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    failpoint::init();
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print as clap renders them; errors get one line.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let text = e.to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: bad arguments"));
            return ExitCode::from(2);
        }
    };
    init_tracing(cli.log_level(), cli.log_format());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            cli::Command::Start(args) => node::run(*args).await,
            cli::Command::Demo(args) => demo::run(args).await,
            cli::Command::Status(args) => status::run(args).await,
            cli::Command::Debug(cmd) => status::debug(cmd).await,
            cli::Command::Node(cmd) => status::node(cmd).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the reason and its causes, as the issue tracker's users expect.
            eprintln!("error: {}", chain(&e));
            ExitCode::FAILURE
        }
    }
}

fn chain(e: &anyhow::Error) -> String {
    let mut s = e.to_string();
    for cause in e.chain().skip(1) {
        // Some errors already print their source in their own message; say it once.
        let cause = cause.to_string();
        if !s.contains(&cause) {
            s.push_str(": ");
            s.push_str(&cause);
        }
    }
    s
}

fn init_tracing(default: &str, format: cli::LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("PGMR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        cli::LogFormat::Json => fmt.json().init(),
        cli::LogFormat::Text => fmt.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}
