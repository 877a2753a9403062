//! Pod filesystem access in a helper process the agent can walk away from.
//!
//! A checkpoint dir is a path a pod controls: it may be a FUSE mount whose daemon takes a request
//! and never answers (or a dead NFS server). A thread that made such a syscall sits in D state in
//! the kernel, unkillable, and a process cannot exit while one of its threads is in the kernel:
//! an agent that touched a hung dir itself could never exit again. So every file operation on a
//! checkpoint dir ([`super::ack::CheckpointDir`]) runs in a helper: a child of the agent's own
//! binary ([`super::child`]), started as `spotguard __pod-fs`, one per open checkpoint dir. The helper opens the dir and keeps it
//! open; the agent sends it one request at a time over a pipe and waits for the answer in `read`
//! on that pipe, an ordinary interruptible wait. When the dir hangs, the helper hangs, not the
//! agent: the agent's waiting thread is abandoned as before (callers enforce their deadlines),
//! and the agent can still exit. A helper exits on end of input (its dir dropped, or the agent
//! gone); one stuck in the kernel goes on when its request is answered or the mount is aborted.
//!
//! Without [`use_helper`] (the library in unit tests) the same operations run in the calling
//! process.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::ack::LocalDir;
use super::child;
use super::procfs::ProcFs;
use super::protocol::{AckName, FileStamp, ForeignAck};
use super::Error;

/// The hidden first argument that makes the binary a helper ([`serve`]).
pub const HELPER_ARG: &str = "__pod-fs";
/// Largest frame either side accepts: the largest answer is the stamps of a dir stuffed with
/// fallback ack names (65,536 names of at most 84 bytes, each with its stamp: about 15 MiB of
/// JSON); a read file is at most 64 KiB.
const MAX_FRAME: u32 = 32 << 20;

/// Run checkpoint dir access in helpers started from `exe` (the daemon: `/proc/self/exe`, the
/// running binary even after it was replaced on disk), and with it every bounded child of
/// [`child`] (the start-up dir check). Set once, before any dir is opened; a spare helper is
/// started at once ([`ready_spare`]).
pub fn use_helper(exe: impl Into<PathBuf>) {
    if child::use_exe(exe) {
        ready_spare();
    }
}

/// A helper started ahead of need: opening a dir takes it (no process start before the signal);
/// a replacement is started when a dir is closed.
static SPARE: Mutex<Option<Helper>> = Mutex::new(None);
/// A replacement spare is being started.
static REFILLING: AtomicBool = AtomicBool::new(false);

/// Start a replacement spare on a thread of its own: when a dir is closed, so that no process
/// is started while a delivery runs (a fork beside it costs its threads milliseconds).
fn refill(exe: &'static Path) {
    if REFILLING.swap(true, Ordering::SeqCst) {
        return;
    }
    let started = std::thread::Builder::new()
        .name("sg-podfs-spare".into())
        .spawn(move || {
            let h = Helper::spawn(exe, "").ok();
            let mut spare = crate::sync::lock(&SPARE);
            if spare.is_none() {
                *spare = h;
            }
            drop(spare);
            REFILLING.store(false, Ordering::SeqCst);
        });
    if started.is_err() {
        REFILLING.store(false, Ordering::SeqCst);
    }
}

/// Start a spare helper now unless one is ready (the daemon at start; benches between runs).
pub fn ready_spare() {
    let Some(exe) = helper() else {
        return;
    };
    let mut spare = crate::sync::lock(&SPARE);
    if spare.is_none() {
        *spare = Helper::spawn(exe, "").ok();
    }
}

/// A started helper: the spare if there is one, else a new one.
fn take_helper(exe: &'static Path, display: &str) -> io::Result<Helper> {
    let spare = crate::sync::lock(&SPARE).take();
    match spare {
        Some(mut h) => {
            h.display = display.to_string();
            Ok(h)
        }
        None => Helper::spawn(exe, display),
    }
}

pub(super) fn helper() -> Option<&'static Path> {
    child::exe()
}

/// A request to the helper.
#[derive(Debug, Serialize, Deserialize)]
enum Request {
    OpenHost {
        dir: PathBuf,
    },
    OpenInRoot {
        proc_root: PathBuf,
        pid: i32,
        start_time: u64,
        dir: PathBuf,
    },
    Stamps {
        names: Vec<String>,
    },
    FallbackAcks,
    RemoveForeign {
        names: Vec<(String, Vec<u32>)>,
    },
    WriteAtomic {
        name: String,
        data: Vec<u8>,
    },
    ReadFile {
        name: String,
        kept: bool,
    },
}

/// The helper's answer to a [`Request`] of the same name.
#[derive(Debug, Serialize, Deserialize)]
enum Response {
    Opened(Result<(), WireError>),
    Stamps(HashMap<String, FileStamp>),
    FallbackAcks(Result<Vec<(String, AckName)>, WireError>),
    Removed(Vec<ForeignAck>),
    Written(Result<(), WireError>),
    File(Result<Option<(Vec<u8>, FileStamp)>, WireError>),
    /// A request before the dir was opened, or after its open failed.
    NotOpen,
}

/// A [`super::Error`] of a dir operation as it crosses the pipe.
#[derive(Debug, Serialize, Deserialize)]
enum WireError {
    ReadAck {
        target: String,
        source: WireIo,
    },
    WriteNotice {
        target: String,
        file: String,
        source: WireIo,
    },
    RefusedAck {
        target: String,
        reason: String,
        ino: u64,
    },
    Other(String),
}

/// An `io::Error`: its errno when it has one, else its kind (as far as callers look) and text.
#[derive(Debug, Serialize, Deserialize)]
struct WireIo {
    errno: Option<i32>,
    invalid_data: bool,
    message: String,
}

impl From<&io::Error> for WireIo {
    fn from(e: &io::Error) -> Self {
        WireIo {
            errno: e.raw_os_error(),
            invalid_data: e.kind() == io::ErrorKind::InvalidData,
            message: e.to_string(),
        }
    }
}

impl From<WireIo> for io::Error {
    fn from(w: WireIo) -> Self {
        match w.errno {
            Some(errno) => io::Error::from_raw_os_error(errno),
            None if w.invalid_data => io::Error::new(io::ErrorKind::InvalidData, w.message),
            None => io::Error::other(w.message),
        }
    }
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> Self {
        match e {
            Error::ReadAck { target, source } => WireError::ReadAck {
                target: target.clone(),
                source: source.into(),
            },
            Error::WriteNotice {
                target,
                file,
                source,
            } => WireError::WriteNotice {
                target: target.clone(),
                file: file.clone(),
                source: source.into(),
            },
            Error::RefusedAck {
                target,
                reason,
                ino,
            } => WireError::RefusedAck {
                target: target.clone(),
                reason: reason.clone(),
                ino: *ino,
            },
            other => WireError::Other(other.to_string()),
        }
    }
}

impl WireError {
    fn into_error(self, display: &str) -> Error {
        match self {
            WireError::ReadAck { target, source } => Error::ReadAck {
                target,
                source: source.into(),
            },
            WireError::WriteNotice {
                target,
                file,
                source,
            } => Error::WriteNotice {
                target,
                file,
                source: source.into(),
            },
            WireError::RefusedAck {
                target,
                reason,
                ino,
            } => Error::RefusedAck {
                target,
                reason,
                ino,
            },
            WireError::Other(message) => Error::ReadAck {
                target: display.to_string(),
                source: io::Error::other(message),
            },
        }
    }
}

fn write_frame<T: Serialize>(out: &mut impl Write, value: &T) -> io::Result<()> {
    let data = serde_json::to_vec(value).map_err(io::Error::other)?;
    let len = u32::try_from(data.len())
        .ok()
        .filter(|l| *l <= MAX_FRAME)
        .ok_or_else(|| io::Error::other("frame too large"))?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(&data)?;
    out.flush()
}

/// `Ok(None)` on end of input before a frame.
fn read_frame<T: serde::de::DeserializeOwned>(input: &mut impl Read) -> io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut data = vec![0u8; len as usize];
    input.read_exact(&mut data)?;
    serde_json::from_slice(&data)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The helper's side (`spotguard __pod-fs`): answer requests on stdin until end of input.
/// Returns the process's exit code.
pub fn serve() -> i32 {
    // The agent's shutdown is the agent's: a Ctrl-C to the terminal's process group (or a
    // SIGTERM to the whole group) must not end the helper while the agent, in its shutdown
    // grace, still reads acks through it. It ends on end of input, or SIGKILL.
    // SAFETY: signal(2) with SIG_IGN, before any other thread exists.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
    let mut input = BufReader::new(io::stdin().lock());
    let mut output = io::stdout().lock();
    let mut dir: Option<LocalDir> = None;
    loop {
        let request = match read_frame::<Request>(&mut input) {
            Ok(Some(r)) => r,
            Ok(None) => return 0,
            Err(_) => return 1,
        };
        let response = answer(&mut dir, request);
        if write_frame(&mut output, &response).is_err() {
            return 1;
        }
    }
}

fn answer(dir: &mut Option<LocalDir>, request: Request) -> Response {
    let opened = |r: Result<LocalDir, Error>, dir: &mut Option<LocalDir>| match r {
        Ok(d) => {
            *dir = Some(d);
            Response::Opened(Ok(()))
        }
        Err(e) => Response::Opened(Err((&e).into())),
    };
    match request {
        Request::OpenHost { dir: path } => opened(LocalDir::host(&path), dir),
        Request::OpenInRoot {
            proc_root,
            pid,
            start_time,
            dir: path,
        } => opened(
            LocalDir::in_root_of(&ProcFs::new(proc_root), pid, start_time, &path),
            dir,
        ),
        _ if dir.is_none() => Response::NotOpen,
        Request::Stamps { names } => {
            Response::Stamps(dir.as_ref().map_or_else(HashMap::new, |d| d.stamps(&names)))
        }
        Request::FallbackAcks => Response::FallbackAcks(
            dir.as_ref()
                .map_or(Ok(Vec::new()), LocalDir::fallback_acks)
                .map_err(|e| (&e).into()),
        ),
        Request::RemoveForeign { names } => Response::Removed(
            dir.as_ref()
                .map_or_else(Vec::new, |d| d.remove_foreign(&names)),
        ),
        Request::WriteAtomic { name, data } => Response::Written(
            dir.as_ref()
                .map_or(Ok(()), |d| d.write_atomic(&name, &data))
                .map_err(|e| (&e).into()),
        ),
        Request::ReadFile { name, kept } => Response::File(
            dir.as_ref()
                .map_or(Ok(None), |d| d.read_file_in(&name, kept))
                .map_err(|e| (&e).into()),
        ),
    }
}

struct Pipes {
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// The agent's side: one helper process holding one checkpoint dir open.
pub(super) struct Helper {
    /// Taken on drop.
    child: Option<Child>,
    /// `None` once a request failed (the helper died or spoke nonsense): every later one fails.
    pipes: Mutex<Option<Pipes>>,
    display: String,
}

impl std::fmt::Debug for Helper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Helper")
            .field("pid", &self.child.as_ref().map(Child::id))
            .finish()
    }
}

impl Helper {
    fn spawn(exe: &Path, display: &str) -> io::Result<Helper> {
        let mut child = child::spawn(exe, HELPER_ARG, &[], Stdio::piped(), Stdio::inherit())?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(io::Error::other("helper without pipes"));
        };
        Ok(Helper {
            child: Some(child),
            pipes: Mutex::new(Some(Pipes {
                stdin,
                stdout: BufReader::new(stdout),
            })),
            display: display.to_string(),
        })
    }

    fn call(&self, request: &Request) -> Result<Response, Error> {
        let mut pipes = crate::sync::lock(&self.pipes);
        let Some(p) = pipes.as_mut() else {
            return Err(self.broken("the pod filesystem helper failed before"));
        };
        let answer = write_frame(&mut p.stdin, request).and_then(|()| read_frame(&mut p.stdout));
        match answer {
            Ok(Some(Response::NotOpen)) | Ok(None) | Err(_) => {
                *pipes = None;
                Err(self.broken(&match answer {
                    Err(e) => format!("pod filesystem helper: {e}"),
                    _ => "pod filesystem helper exited".to_string(),
                }))
            }
            Ok(Some(r)) => Ok(r),
        }
    }

    fn broken(&self, why: &str) -> Error {
        Error::ReadAck {
            target: self.display.clone(),
            source: io::Error::other(why.to_string()),
        }
    }

    /// Start a helper and open `dir` on the host in it.
    pub(super) fn open_host(
        exe: &'static Path,
        dir: &Path,
        display: &str,
    ) -> Result<Helper, Error> {
        Self::open(
            exe,
            display,
            Request::OpenHost {
                dir: dir.to_path_buf(),
            },
        )
    }

    /// Start a helper and open `dir` in it inside the root of `pid` (checked by start time).
    pub(super) fn open_in_root(
        exe: &'static Path,
        proc: &ProcFs,
        pid: i32,
        start_time: u64,
        dir: &Path,
        display: &str,
    ) -> Result<Helper, Error> {
        Self::open(
            exe,
            display,
            Request::OpenInRoot {
                proc_root: proc.root().to_path_buf(),
                pid,
                start_time,
                dir: dir.to_path_buf(),
            },
        )
    }

    fn open(exe: &'static Path, display: &str, request: Request) -> Result<Helper, Error> {
        let start_failed = |source: io::Error| Error::ReadAck {
            target: display.to_string(),
            source: io::Error::new(
                source.kind(),
                format!("starting the pod filesystem helper: {source}"),
            ),
        };
        let mut helper = take_helper(exe, display).map_err(start_failed)?;
        let answer = match helper.call(&request) {
            // A spare that died while it waited: once more with a new one.
            Err(_) => {
                helper = Self::spawn(exe, display).map_err(start_failed)?;
                helper.call(&request)?
            }
            Ok(r) => r,
        };
        match answer {
            Response::Opened(Ok(())) => Ok(helper),
            Response::Opened(Err(e)) => Err(e.into_error(display)),
            other => Err(helper.unexpected(&other)),
        }
    }

    fn unexpected(&self, r: &Response) -> Error {
        self.broken(&format!("pod filesystem helper answered {r:?}"))
    }

    pub(super) fn stamps(&self, names: &[String]) -> HashMap<String, FileStamp> {
        match self.call(&Request::Stamps {
            names: names.to_vec(),
        }) {
            Ok(Response::Stamps(s)) => s,
            _ => HashMap::new(),
        }
    }

    pub(super) fn fallback_acks(&self) -> Result<Vec<(String, AckName)>, Error> {
        match self.call(&Request::FallbackAcks)? {
            Response::FallbackAcks(r) => r.map_err(|e| e.into_error(&self.display)),
            other => Err(self.unexpected(&other)),
        }
    }

    pub(super) fn remove_foreign(&self, names: &[(String, Vec<u32>)]) -> Vec<ForeignAck> {
        match self.call(&Request::RemoveForeign {
            names: names.to_vec(),
        }) {
            Ok(Response::Removed(r)) => r,
            _ => Vec::new(),
        }
    }

    pub(super) fn write_atomic(&self, name: &str, data: &[u8]) -> Result<(), Error> {
        let request = Request::WriteAtomic {
            name: name.to_string(),
            data: data.to_vec(),
        };
        match self.call(&request)? {
            Response::Written(r) => r.map_err(|e| e.into_error(&self.display)),
            other => Err(self.unexpected(&other)),
        }
    }

    pub(super) fn read_file_in(
        &self,
        name: &str,
        kept: bool,
    ) -> Result<Option<(Vec<u8>, FileStamp)>, Error> {
        let request = Request::ReadFile {
            name: name.to_string(),
            kept,
        };
        match self.call(&request)? {
            Response::File(r) => r.map_err(|e| e.into_error(&self.display)),
            other => Err(self.unexpected(&other)),
        }
    }
}

impl Drop for Helper {
    /// Never waits: the pipes are closed (an idle helper sees end of input and exits) and the
    /// helper is killed; one that has not exited yet (stuck in the kernel) is reaped later.
    fn drop(&mut self) {
        drop(self.pipes.get_mut().map(Option::take));
        let Some(c) = self.child.take() else {
            return;
        };
        child::abandon(c);
        if let Some(exe) = helper() {
            if SPARE.lock().map_or(true, |s| s.is_none()) {
                refill(exe);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_answer_fits_a_frame() {
        // A dir stuffed with fallback names of the longest kind: every one listed and stamped.
        let stamp = FileStamp {
            dev: u64::MAX,
            ino: u64::MAX,
            uid: u32::MAX,
            size: u64::MAX,
            ctime: (i64::MIN, i64::MIN),
            mtime: (i64::MIN, i64::MIN),
        };
        let stamps: HashMap<String, FileStamp> = (0..65_536)
            .map(|i| (format!("ack-{}.{:0>64}.json", i32::MAX - i, i), stamp))
            .collect();
        let mut frame = Vec::new();
        write_frame(&mut frame, &Response::Stamps(stamps)).unwrap();
        assert!(
            frame.len() as u64 <= u64::from(MAX_FRAME),
            "{}",
            frame.len()
        );
        let back: Response = read_frame(&mut frame.as_slice()).unwrap().unwrap();
        assert!(matches!(back, Response::Stamps(s) if s.len() == 65_536));
    }

    #[test]
    fn errors_cross_the_pipe_with_their_errno_and_kind() {
        let cross = |e: Error| {
            let mut frame = Vec::new();
            write_frame(&mut frame, &Response::Written(Err((&e).into()))).unwrap();
            match read_frame(&mut frame.as_slice()).unwrap() {
                Some(Response::Written(Err(w))) => w.into_error("d"),
                other => panic!("{other:?}"),
            }
        };
        let Error::ReadAck { source, .. } = cross(Error::ReadAck {
            target: "t".into(),
            source: io::Error::from_raw_os_error(libc::ENOENT),
        }) else {
            panic!("not ReadAck")
        };
        assert_eq!(source.kind(), io::ErrorKind::NotFound);
        let Error::WriteNotice { source, file, .. } = cross(Error::WriteNotice {
            target: "t".into(),
            file: "notice.json".into(),
            source: io::Error::new(io::ErrorKind::InvalidData, "not a regular file"),
        }) else {
            panic!("not WriteNotice")
        };
        assert_eq!(
            (source.kind(), file.as_str()),
            (io::ErrorKind::InvalidData, "notice.json")
        );
        assert!(source.to_string().contains("not a regular file"));
        assert!(matches!(
            cross(Error::RefusedAck {
                target: "t".into(),
                reason: "r".into(),
                ino: 7
            }),
            Error::RefusedAck { ino: 7, .. }
        ));
    }

    #[test]
    fn end_of_input_ends_the_helper_and_a_torn_frame_is_an_error() {
        assert!(read_frame::<Request>(&mut [].as_slice()).unwrap().is_none());
        let mut torn = Vec::new();
        write_frame(&mut torn, &Request::FallbackAcks).unwrap();
        torn.pop();
        assert!(read_frame::<Request>(&mut torn.as_slice()).is_err());
        let huge = (MAX_FRAME + 1).to_le_bytes();
        assert!(read_frame::<Request>(&mut huge.as_slice()).is_err());
    }
}
