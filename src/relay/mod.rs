//! The relay (docs/relay.md): a doomed node's agent streams a staged checkpoint it cannot
//! upload before the notice's deadline to a peer agent, which verifies every file against the
//! sender's checksums and publishes it to the job's location with the sender's manifest.
//!
//! - [`auth`]: who may send: the node key (host mode) or an agent's reviewed token (Kubernetes);
//! - [`lease`]: Kubernetes peers: each receiver's Lease, and the sender's list of them;
//! - [`wire`]: the versioned wire format (HTTP/1.1 over TLS);
//! - [`tls`]: the node's self-signed certificate and the sender's fingerprint pinning;
//! - [`stage`]: the receiver's staging volume (each relay's files and journal);
//! - [`receive`]: the receiver (`--relay-listen`): [`auth`] first, reservations under a cap per
//!   sender and the free space, every byte as hostile input, publication through a
//!   [`Publisher`];
//! - [`send`]: the sender: a staged tree's files to one peer, then the commit and its outcome;
//! - [`metrics`]: `spotguard_relay_*`, counted by the receiver and by the sender's race.
//!
//! The relay stands on the `store` floor beside `upload`, and never imports it: publication is
//! the [`Publisher`] seam, which `upload::relayed` implements with the upload engine.

pub mod auth;
pub mod lease;
pub mod metrics;
pub mod receive;
pub mod send;
pub mod stage;
pub mod tls;
pub mod wire;

use std::path::PathBuf;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::store::crc::Crcs;

/// `spotguard relay …`.
#[derive(Debug, clap::Args)]
pub struct RelayArgs {
    #[command(subcommand)]
    pub command: RelayCommand,
}

/// `spotguard relay …`.
#[derive(Debug, clap::Subcommand)]
pub enum RelayCommand {
    /// Print this node's relay certificate fingerprint (SHA-256, hex), making the certificate if
    /// there is none yet: what senders put after the `#` of --relay-peers.
    Fingerprint {
        /// The agent's state dir (the certificate is kept in its relay/).
        #[arg(
            long,
            env = "SPOTGUARD_STATE_DIR",
            value_name = "DIR",
            default_value = "/var/lib/spotguard"
        )]
        state_dir: PathBuf,
    },
}

/// Run `spotguard relay …`; the exit code.
pub fn run_cli(args: RelayArgs) -> i32 {
    match args.command {
        RelayCommand::Fingerprint { state_dir } => {
            match tls::Identity::load_or_create(&tls::dir(&state_dir)) {
                Ok(id) => {
                    println!("{}", tls::hex(&id.fingerprint));
                    0
                }
                Err(e) => {
                    eprintln!("spotguard relay fingerprint: {e}");
                    1
                }
            }
        }
    }
}

/// What the relay refused or failed at.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("relay TLS: {reason}")]
    Tls { reason: String },
    /// The peer could not be reached or its connection broke.
    #[error("relay peer {peer}: {reason}")]
    Peer { peer: String, reason: String },
    /// The peer answered with a refusal.
    #[error("relay peer {peer} refused ({status}): {reason}")]
    Refused {
        peer: String,
        status: u16,
        reason: String,
    },
    #[error("relay to {peer} cancelled")]
    Cancelled { peer: String },
    /// The peer had not published by the notice's deadline: the relay is not finished.
    #[error("relay to {peer}: not published by the deadline")]
    Deadline { peer: String },
}

/// A verified relay ready to publish: the staged files under `dir`, in the reservation's order
/// with the sender's checksums.
#[derive(Debug)]
pub struct PublishJob {
    pub dir: PathBuf,
    pub reserve: wire::Reserve,
    pub crcs: Vec<Crcs>,
    pub cancel: CancellationToken,
}

/// How a publication ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Published {
    Published,
    /// Another writer (the sender's own upload) published the same checkpoint first.
    AlreadyPublished,
    Failed(String),
}

/// The seam to the publication path: the receiver asks it whether it may publish a
/// reservation's checkpoint at all (its own allow-list and writer rules, before a byte is
/// accepted), and to publish a verified one exactly as the sender would have (files, then the
/// manifest, created only if absent).
pub trait Publisher: Send + Sync + 'static {
    /// `Err`: why this agent does not publish to the reservation's location.
    fn check(&self, reserve: &wire::Reserve) -> Result<(), String>;
    fn publish(&self, job: PublishJob) -> BoxFuture<'static, Published>;
}
