//! Documentation drift: every metric family registered in the source appears in docs/metrics.md.

use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_registered_metric_is_documented() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut names = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        // `register(` / `register_with_unit(` / `sub-collectors` take the family name first.
        for (i, _) in text.match_indices("\"spotguard_") {
            let rest = &text[i + 1..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let before = &text[..i];
            let registered = before
                .rfind("register")
                .is_some_and(|r| i - r < 80 && !before[r..].contains(';'));
            if registered && !name.ends_with('_') {
                names.push((name, f.display().to_string()));
            }
        }
    }
    assert!(names.len() > 30, "found only {} registrations", names.len());
    for (name, file) in names {
        let documented = docs.contains(&format!("`{name}`"))
            || docs.contains(&format!("`{name}_total`"))
            || docs.contains(&format!("`{name}_info`"))
            || docs.contains(&format!("{name}`"))
            || docs.contains(&format!("{name}_total`"));
        assert!(
            documented,
            "{name} (registered in {file}) is not in docs/metrics.md"
        );
    }
}
