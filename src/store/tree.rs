//! The rules every checkpoint tree obeys, wherever it comes from: a trainer's staged directory
//! (`upload::staged`, walked through the trainer's root) or a peer's relay stream (`relay`, read
//! off the wire). Both are hostile input and both are held to the same [`Limits`] and the same
//! file paths ([`check_file`]).

use super::manifest;

/// Bounds on what one staged checkpoint may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Files (each is held open until its upload ends).
    pub max_files: usize,
    /// Bytes in all.
    pub max_bytes: u64,
    /// Directory levels below the staged directory.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_files: 10_000,
            max_bytes: 1 << 40,
            max_depth: 32,
        }
    }
}

/// A file path a tree may hold under these limits: what a manifest may list
/// ([`manifest::check_path`]), a valid object key ([`super::validate_key`]), at most
/// `max_depth` directory levels deep. `Err` says why not.
pub fn check_file(path: &str, limits: &Limits) -> Result<(), String> {
    manifest::check_path(path).map_err(str::to_string)?;
    super::validate_key(path).map_err(|e| e.to_string())?;
    let depth = path.matches('/').count();
    if depth > limits.max_depth {
        return Err(format!("more than {} levels", limits.max_depth));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_path_is_checked_like_a_staged_one() {
        let l = Limits {
            max_depth: 2,
            ..Limits::default()
        };
        for ok in ["a", "a/b", "a/b/c.bin", "shard-00001.safetensors"] {
            assert_eq!(check_file(ok, &l), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a\u{0}b",
            "manifest.json",
            "manifest.part-0-of-2.json",
            "a/b/c/d",
        ] {
            assert!(check_file(bad, &l).is_err(), "{bad:?} passed");
        }
        assert!(check_file("sub/manifest.json", &l).is_ok());
    }
}
