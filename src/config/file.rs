//! The config file (`--config FILE`, TOML): keys named like `run`'s flags are merged below the
//! command line and the environment; `[[datasets]]` and the `[gpu]` table are read as structures.

use std::ffi::OsString;
use std::path::Path;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, FromArgMatches};
use serde::Deserialize;

use super::origin::settings_of;
use super::parse::parse_bool;
use super::{Error, RunArgs};

/// A dataset to prefetch: `NAME=URL`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Dataset {
    pub name: String,
    pub url: String,
}

/// The structured parts of the config file (everything else maps onto the flags).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileExtras {
    #[serde(default)]
    datasets: Vec<Dataset>,
    #[serde(default)]
    gpu: Option<toml::Table>,
}

/// Keys of the config file that are not flags.
const STRUCTURED_KEYS: &[&str] = &["datasets", "gpu"];

/// Complete `run`'s settings with the config file (`--config`) below the command line and the
/// environment: `matches` are what `cmd` parsed from `args`; each file key that clap's value source
/// says was neither given on the command line nor set in the environment is parsed again as
/// `--key=value` ahead of `args`, so that flag > env > file > default holds and clap validates file
/// values like any other. Records where each setting came from.
pub(crate) fn merge_config_file(
    cmd: &clap::Command,
    matches: &ArgMatches,
    args: &[OsString],
) -> Result<RunArgs, Error> {
    let mut run = RunArgs::from_arg_matches(matches).map_err(|e| Error::Cli(e.to_string()))?;
    let file_args = match &run.config {
        Some(file) => config_file_args(file, cmd, matches)?,
        None => Vec::new(),
    };
    if file_args.is_empty() {
        run.settings = settings_of(cmd, matches, &[]);
        return Ok(run);
    }
    let merged: Vec<OsString> = std::iter::once(OsString::from("spotguard"))
        .chain(file_args.iter().map(|(_, arg)| OsString::from(arg)))
        .chain(args.iter().cloned())
        .collect();
    let file_error = |reason: String| Error::File {
        path: run
            .config
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        reason,
    };
    let merged = cmd
        .clone()
        .try_get_matches_from(&merged)
        .map_err(|e| file_error(e.render().to_string().trim().to_string()))?;
    let mut run = RunArgs::from_arg_matches(&merged).map_err(|e| Error::Cli(e.to_string()))?;
    let from_file: Vec<&str> = file_args.iter().map(|(key, _)| key.as_str()).collect();
    run.settings = settings_of(cmd, &merged, &from_file);
    Ok(run)
}

/// Read the config file and turn its keys into `--key=value` arguments of `cmd` (with their key),
/// leaving out keys that `matches` took from the command line or the environment; each key is
/// validated on its own so that an error names the file and the key.
fn config_file_args(
    path: &Path,
    cmd: &clap::Command,
    matches: &ArgMatches,
) -> Result<Vec<(String, String)>, Error> {
    let file = path.display().to_string();
    let table = read_table(path)?;
    let mut out = Vec::new();
    // Each setting once: `poll-interval` and `poll_interval` are one key.
    let mut spelled: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
    for (raw_key, value) in &table {
        if STRUCTURED_KEYS.contains(&raw_key.as_str()) {
            continue;
        }
        let at = KeyAt {
            file: &file,
            key: raw_key,
        };
        let key = raw_key.replace('_', "-");
        if let Some(other) = spelled.insert(key.clone(), raw_key) {
            return Err(at.error(format!(
                "the same setting as `{other}` (`-` and `_` are one): give it once"
            )));
        }
        let arg = cmd
            .get_arguments()
            .find(|a| {
                a.get_long() == Some(key.as_str()) && !a.is_hide_set() && !is_help_or_version(a)
            })
            .ok_or_else(|| at.error("unknown key"))?;
        if key == "config" {
            return Err(at.error("a config file cannot name another config file"));
        }
        // Given as a flag (in any form) or in the environment: they win over the file.
        if matches!(
            matches.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let is_switch = matches!(arg.get_action(), ArgAction::SetTrue);
        for v in file_values(value, &at)? {
            let Some(one) = flag_for(&key, &v, is_switch, &at)? else {
                continue;
            };
            check_alone(cmd, &one, &at)?;
            out.push((key.clone(), one));
        }
    }
    Ok(out)
}

/// Largest config file read: real ones are a few KiB.
const MAX_FILE: u64 = 1024 * 1024;

/// The config file at `path`, read and parsed as a TOML table. Only a regular file is read: it is
/// opened without blocking (`O_NONBLOCK`: a FIFO with no writer would hold start-up forever) and
/// anything else (a FIFO, a device, a directory, a socket) is refused at once, as is a file
/// larger than [`MAX_FILE`].
fn read_table(path: &Path) -> Result<toml::Table, Error> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = path.display().to_string();
    let error = |reason: String| Error::File {
        path: file.clone(),
        reason,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| error(e.to_string()))?;
    let meta = f.metadata().map_err(|e| error(e.to_string()))?;
    let t = meta.file_type();
    if !t.is_file() {
        let what = if t.is_fifo() {
            "a FIFO"
        } else if t.is_dir() {
            "a directory"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(error(format!("is {what}: give a regular file")));
    }
    if meta.len() > MAX_FILE {
        return Err(error(format!(
            "is larger than {MAX_FILE} bytes: not a config file"
        )));
    }
    let mut text = String::new();
    f.take(MAX_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| error(e.to_string()))?;
    text.parse().map_err(|e: toml::de::Error| Error::File {
        path: file,
        reason: e.to_string().trim().to_string(),
    })
}

/// A key of the config file, as its errors name it.
struct KeyAt<'a> {
    file: &'a str,
    key: &'a str,
}

impl KeyAt<'_> {
    fn error(&self, reason: impl Into<String>) -> Error {
        Error::FileKey {
            path: self.file.to_string(),
            key: self.key.to_string(),
            reason: reason.into(),
        }
    }
}

/// A key's value as strings: each item of a list, else the one scalar.
fn file_values(value: &toml::Value, at: &KeyAt) -> Result<Vec<String>, Error> {
    match value {
        toml::Value::Array(items) => items
            .iter()
            .map(toml_scalar)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| at.error("expected a list of strings, numbers or booleans")),
        v => Ok(vec![toml_scalar(v).ok_or_else(|| {
            at.error("expected a string, number or boolean")
        })?]),
    }
}

/// The flag that gives `--key` the value `v`. Switches take no value: `true` gives the bare
/// flag, `false` the default (`None`).
fn flag_for(key: &str, v: &str, is_switch: bool, at: &KeyAt) -> Result<Option<String>, Error> {
    if !is_switch {
        return Ok(Some(format!("--{key}={v}")));
    }
    match parse_bool(v) {
        Ok(true) => Ok(Some(format!("--{key}"))),
        Ok(false) => Ok(None),
        Err(reason) => Err(at.error(reason)),
    }
}

/// Validate the flag `one` alone, so that the error names the file and key.
fn check_alone(cmd: &clap::Command, one: &str, at: &KeyAt) -> Result<(), Error> {
    if let Err(e) = cmd.clone().try_get_matches_from(["spotguard", one]) {
        let msg = e.render().to_string();
        let reason = msg
            .lines()
            .next()
            .unwrap_or("invalid value")
            .trim_start_matches("error: ")
            .to_string();
        return Err(at.error(reason));
    }
    Ok(())
}

/// clap's own `--help` / `--version`: not settings.
fn is_help_or_version(a: &clap::Arg) -> bool {
    matches!(
        a.get_action(),
        ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
    )
}

fn toml_scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

pub(super) fn read_extras(path: &Path) -> Result<(Vec<Dataset>, Option<toml::Table>), Error> {
    let file = path.display().to_string();
    let mut table = read_table(path)?;
    table.retain(|k, _| STRUCTURED_KEYS.contains(&k));
    let extras: FileExtras =
        toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| Error::File {
                path: file.clone(),
                reason: e.to_string().trim().to_string(),
            })?;
    Ok((extras.datasets, extras.gpu))
}

pub(super) fn validate_dataset(d: &Dataset) -> Result<(), String> {
    let spec = format!("{}={}", d.name, d.url);
    crate::prefetch::parse_spec(&spec)
        .map(|_| ())
        .map_err(|e| format!("dataset {:?}: {e}", d.name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::{config_file, run_command_with_shorts};
    use crate::config::Origin;
    use std::time::Duration;

    #[test]
    fn a_flag_in_any_form_beats_the_config_file() {
        let (_dir, path) =
            config_file("poll-interval = \"3s\"\ncheckpoint-cmdline = [\"train\"]\n");
        let p = path.to_str().unwrap();
        let cmd = run_command_with_shorts();
        let merge = |given: &[&str]| {
            let argv: Vec<OsString> = ["spotguard", "--config", p]
                .iter()
                .chain(given)
                .map(OsString::from)
                .collect();
            let matches = cmd.clone().try_get_matches_from(&argv).unwrap();
            merge_config_file(&cmd, &matches, &argv[1..]).unwrap()
        };
        let origin = |run: &RunArgs, key: &str| {
            run.settings
                .iter()
                .find(|s| s.key == key)
                .map(|s| s.origin)
                .unwrap()
        };
        for given in [
            &["--poll-interval", "2s", "--checkpoint-cmdline", "torchrun"][..],
            &["--poll-interval=2s", "--checkpoint-cmdline=torchrun"],
            &["-p", "2s", "-c", "torchrun"],
            &["-p2s", "-ctorchrun"],
            &["--poll", "2s", "-c=torchrun"],
            &["--poll=2s", "-c", "torchrun"],
        ] {
            let run = merge(given);
            assert_eq!(run.poll_interval, Duration::from_secs(2), "{given:?}");
            let cmdline: Vec<&str> = run.checkpoint_cmdline.iter().map(|r| r.as_str()).collect();
            assert_eq!(
                cmdline,
                ["torchrun"],
                "{given:?}: the file's list not added"
            );
            assert_eq!(origin(&run, "poll-interval"), Origin::Flag, "{given:?}");
            assert_eq!(
                origin(&run, "checkpoint-cmdline"),
                Origin::Flag,
                "{given:?}"
            );
        }
        let run = merge(&[]);
        assert_eq!(run.poll_interval, Duration::from_secs(3));
        assert_eq!(origin(&run, "poll-interval"), Origin::File);
        assert_eq!(origin(&run, "checkpoint-cmdline"), Origin::File);
        assert_eq!(origin(&run, "checkpoint-timeout"), Origin::Default);
    }
}
