//! Build script: records the git commit for `--version` and `spotguard_build_info{commit}`.
//! Falls back to `SPOTGUARD_GIT_COMMIT` from the environment, then to `unknown` (a source
//! tarball has no .git).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SPOTGUARD_GIT_COMMIT");
    let from_env = std::env::var("SPOTGUARD_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty());
    let commit = from_env
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SPOTGUARD_GIT_COMMIT={commit}");
}

fn git_commit() -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        if !out.status.success() {
            return None;
        }
        let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
        (!s.is_empty()).then_some(s)
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    // Rebuild when HEAD moves (worktrees keep HEAD elsewhere: ask git where).
    if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={head}");
    }
    if let Some(refname) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(path) = git(&["rev-parse", "--git-path", &refname]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    Some(commit)
}
