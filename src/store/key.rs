//! Object keys and local names both directions agree on: which key may become a local path
//! ([`validate_key`]: nothing that escapes the directory or clashes with spotguard's own files),
//! the part-file infix ([`PART_INFIX`]) and the short hash that names claims and journals.

use sha2::{Digest, Sha256};

use super::Error;

/// The per-dataset (and per-checkpoint) directory of spotguard's own files.
pub const META_DIR: &str = ".spotguard";
/// In a file name: a part file of an unfinished download, never a published file.
pub const PART_INFIX: &str = ".spotguard-part-";
/// The longest file name (one path segment) of Linux filesystems.
pub const NAME_MAX: usize = 255;

/// A short, stable hash of `s` (16 hex digits of SHA-256), used for claim and journal file names.
pub fn short_hash(s: &str) -> String {
    let digest = Sha256::digest(s.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Reject keys that would escape the dataset directory or clash with spotguard's own files.
pub fn validate_key(key: &str) -> Result<(), Error> {
    let unsafe_key = |reason: &str| Error::UnsafeKey {
        key: key.to_string(),
        reason: reason.to_string(),
    };
    if key.is_empty() {
        return Err(unsafe_key("empty key"));
    }
    if key.starts_with('/') {
        return Err(unsafe_key("absolute path"));
    }
    if key.contains('\0') {
        return Err(unsafe_key("NUL byte"));
    }
    if key.contains(PART_INFIX) {
        return Err(unsafe_key("contains spotguard's part-file infix"));
    }
    for (i, seg) in key.split('/').enumerate() {
        match seg {
            "" => return Err(unsafe_key("empty path segment")),
            "." | ".." => return Err(unsafe_key("'.' or '..' segment escapes the dataset")),
            META_DIR if i == 0 => return Err(unsafe_key("clashes with the .spotguard directory")),
            s if s.len() > NAME_MAX => {
                return Err(unsafe_key("path segment longer than 255 bytes"))
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_escape_are_rejected_by_name() {
        for key in ["a/b.bin", "x", "deep/er/file.tar", "..x", "a/.spotguard"] {
            assert!(validate_key(key).is_ok(), "{key}");
        }
        for key in [
            "",
            "/etc/passwd",
            "../up",
            "a/../../b",
            "a//b",
            "./a",
            ".spotguard/manifest.json",
            "a\0b",
            "a.spotguard-part-h-1",
        ] {
            match validate_key(key) {
                Err(Error::UnsafeKey { key: k, .. }) => assert_eq!(k, key),
                other => panic!("{key:?}: {other:?}"),
            }
        }
        let e = validate_key("a/../../etc").unwrap_err();
        assert!(e.to_string().contains("a/../../etc"), "{e}");
    }
}
