//! Where each setting came from (flag, environment, config file or default), as clap's value
//! sources say: the effective-configuration line, `config check`'s table (secrets redacted), and a
//! bad value from the environment named by its `SPOTGUARD_*` variable.

use std::ffi::OsString;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches};

use super::args::run_command;

/// Where a setting came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Env,
    File,
    Default,
}

impl Origin {
    /// The origin of a value clap took from `source`; `from_file`: the config file's value was
    /// passed as a command-line argument.
    pub(crate) fn of(source: ValueSource, from_file: bool) -> Origin {
        match source {
            ValueSource::CommandLine if from_file => Origin::File,
            ValueSource::CommandLine => Origin::Flag,
            ValueSource::EnvVariable => Origin::Env,
            _ => Origin::Default,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Flag => "flag",
            Origin::Env => "env",
            Origin::File => "file",
            Origin::Default => "default",
        }
    }
}

/// One effective setting of `run`, for the start-up log line and `config check`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The flag's name without dashes, e.g. `poll-interval`.
    pub key: String,
    /// The value as given (secrets and URL credentials redacted), lists joined with `,`.
    pub value: String,
    /// The value as the agent read it: a duration in seconds (`600s` for `10m`), a size in bytes
    /// (`500000000000 bytes` for `500G`), a list as its items (`["a", "b"]`); anything else as
    /// given.
    pub read: String,
    pub origin: Origin,
}

/// Flags whose values are secrets: shown as `<redacted>`.
const SECRET_KEYS: &[&str] = &["webhook-url", "webhook-header", "webhook-routing-key"];

/// A value error in a setting that came from the environment names the `SPOTGUARD_*` variable
/// (clap's own message names the flag, which the user never typed). `cmd` is the command `argv`
/// was parsed with.
pub(crate) fn env_value_error(
    e: &clap::Error,
    cmd: &clap::Command,
    argv: &[OsString],
) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return None;
    }
    let ContextValue::String(arg) = e.get(ContextKind::InvalidArg)? else {
        return None;
    };
    let long = arg.strip_prefix("--")?.split([' ', '=']).next()?;
    let run = run_command();
    let a = run.get_arguments().find(|a| a.get_long() == Some(long))?;
    let env = a.get_env()?.to_string_lossy().into_owned();
    if std::env::var_os(&env).is_none() || given_on_command_line(e, cmd, argv) {
        return None;
    }
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => v.clone(),
        _ => String::new(),
    };
    let rendered = e.render().to_string();
    let first = rendered.lines().next().unwrap_or_default();
    let reason = first
        .split_once(&format!("'{arg}': "))
        .map(|(_, r)| r.to_string())
        .unwrap_or_else(|| "not a valid value".into());
    Some(format!(
        "error: invalid value '{value}' in environment variable {env} (sets --{long}): {reason}\n"
    ))
}

/// Whether the value `e` is about was given on the command line (in any form: `--flag value`,
/// `--flag=value`, a short flag or an alias): parsing `argv` again without the environment fails
/// the same way.
fn given_on_command_line(e: &clap::Error, cmd: &clap::Command, argv: &[OsString]) -> bool {
    use clap::error::ContextKind;
    fn without_env(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| a.env(None)).mut_subcommands(without_env)
    }
    match without_env(cmd.clone()).try_get_matches_from(argv) {
        Ok(_) => false,
        Err(again) => {
            again.kind() == e.kind()
                && again.get(ContextKind::InvalidArg) == e.get(ContextKind::InvalidArg)
        }
    }
}

/// Every `run` setting with a value, with its origin (`from_file`: the keys the config file set).
pub(super) fn settings_of(
    cmd: &clap::Command,
    matches: &ArgMatches,
    from_file: &[&str],
) -> Vec<Setting> {
    let mut out = Vec::new();
    for a in cmd.get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if a.is_hide_set() || long == "help" {
            continue;
        }
        let id = a.get_id().as_str();
        let Some(source) = matches.value_source(id) else {
            continue;
        };
        let origin = Origin::of(source, from_file.contains(&long));
        let secret = SECRET_KEYS.contains(&long);
        let raw: Vec<String> = matches
            .get_raw(id)
            .map(|vals| {
                vals.map(|v| crate::words::without_credentials(&v.to_string_lossy()))
                    .collect()
            })
            .unwrap_or_default();
        let shown = |vals: &[String]| {
            if secret {
                "<redacted>".to_string()
            } else {
                vals.join(",")
            }
        };
        let value = shown(&raw);
        let value = if value.is_empty() && matches!(a.get_action(), ArgAction::SetTrue) {
            "true".to_string()
        } else {
            value
        };
        let unit = a
            .get_value_names()
            .and_then(|n| n.first())
            .map(|n| n.as_str());
        let items: Vec<String> = raw.iter().map(|v| as_read(v, unit)).collect();
        let read = if secret {
            value.clone()
        } else if matches!(a.get_action(), ArgAction::Append) {
            // A list as the list it was read as: `["sgtrain", "torchrun"]`.
            format!("{items:?}")
        } else if matches!(unit, Some("DURATION") | Some("BYTES")) {
            items.join(",")
        } else {
            value.clone()
        };
        out.push(Setting {
            key: long.to_string(),
            value,
            read,
            origin,
        });
    }
    out
}

/// A duration (`unit` `DURATION`) in seconds, a size (`BYTES`) in bytes, as the parsers read
/// `v` (which clap has already accepted).
fn as_read(v: &str, unit: Option<&str>) -> String {
    match unit {
        Some("DURATION") => match crate::duration::parse(v) {
            Ok(d) if d.subsec_nanos() == 0 => format!("{}s", d.as_secs()),
            Ok(d) => format!("{}s", d.as_secs_f64()),
            Err(_) => v.to_string(),
        },
        Some("BYTES") => match crate::units::parse_limit(v) {
            Ok(n) => format!("{n} bytes"),
            Err(_) => v.to_string(),
        },
        _ => v.to_string(),
    }
}

/// `key=value (origin)` for every setting, space-separated: the effective-configuration line.
pub fn settings_line(settings: &[Setting]) -> String {
    settings
        .iter()
        .map(|s| format!("{}={} ({})", s.key, s.value, s.origin.as_str()))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::run_command_with_shorts;

    #[test]
    fn a_bad_value_is_blamed_on_the_command_line_only_when_given_there() {
        // PATH is set in every test process and is not a duration: a bad value from the environment.
        let cmd = run_command_with_shorts().mut_arg("poll_interval", |a| a.env("PATH"));
        let argv = |given: &[&str]| -> Vec<OsString> {
            std::iter::once("spotguard")
                .chain(given.iter().copied())
                .map(OsString::from)
                .collect()
        };
        let e = cmd.clone().try_get_matches_from(argv(&[])).unwrap_err();
        assert!(!given_on_command_line(&e, &cmd, &argv(&[])), "{e}");
        for given in [
            &["--poll-interval", "soon"][..],
            &["--poll-interval=soon"],
            &["-p", "soon"],
            &["--poll=soon"],
        ] {
            let e = cmd.clone().try_get_matches_from(argv(given)).unwrap_err();
            assert!(e.to_string().contains("--poll-interval"), "{e}");
            assert!(
                given_on_command_line(&e, &cmd, &argv(given)),
                "{given:?}: {e}"
            );
        }
    }
}
