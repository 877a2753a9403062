//! Which way the imports point between the crate's top-level modules (docs/architecture.md,
//! "Which way the arrows point"). Every `crate::X` a module under `src/` names is an arrow from
//! it to `X`; each arrow must be in [`ALLOWED`], and [`ALLOWED`] itself has no cycle. A new
//! import against the direction (node/ reaching up into the responder, say) fails here: move the
//! thing it needs down instead, or, when the arrow is right, add it to the table and to the doc.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module and the modules it may import. Lower layers first.
const ALLOWED: &[(&str, &[&str])] = &[
    // Leaves: import nothing of the crate's.
    ("backoff", &[]),
    ("duration", &[]),
    ("fsutil", &[]),
    ("loader_pages", &[]),
    ("metrics", &[]),
    ("shutdown", &[]),
    ("sync", &[]),
    ("units", &[]),
    ("words", &[]),
    ("life", &["fsutil", "sync"]),
    // The object-store floor both transfer directions share.
    ("store", &["sync", "units", "words"]),
    ("admin", &["metrics", "sync"]),
    // The node seam (it stores the responder's plan record as given), the notice sources.
    ("node", &["backoff", "duration", "metrics"]),
    (
        "notice",
        &["backoff", "duration", "metrics", "sync", "words"],
    ),
    (
        "webhook",
        &["backoff", "duration", "metrics", "notice", "words"],
    ),
    ("emulator", &["duration", "notice", "sync"]),
    ("gpu", &["backoff", "duration", "life", "node", "sync"]),
    (
        "checkpoint",
        &["backoff", "duration", "fsutil", "metrics", "node", "sync"],
    ),
    (
        "prefetch",
        &[
            "admin",
            "backoff",
            "checkpoint",
            "duration",
            "fsutil",
            "metrics",
            "node",
            "store",
            "sync",
            "units",
        ],
    ),
    // The relay: beside upload on the store floor; upload publishes what it receives.
    ("relay", &["admin", "fsutil", "metrics", "store", "sync"]),
    (
        "upload",
        &[
            "checkpoint",
            "duration",
            "fsutil",
            "life",
            "metrics",
            "node",
            "relay",
            "store",
            "sync",
            "units",
        ],
    ),
    (
        "config",
        &[
            "checkpoint",
            "duration",
            "gpu",
            "notice",
            "prefetch",
            "relay",
            "store",
            "units",
            "upload",
            "webhook",
            "words",
        ],
    ),
    ("telemetry", &["config"]),
    (
        "responder",
        &[
            "backoff",
            "checkpoint",
            "config",
            "duration",
            "fsutil",
            "life",
            "metrics",
            "node",
            "notice",
            "sync",
            "units",
            "upload",
        ],
    ),
    ("goodput", &["checkpoint", "fsutil", "metrics", "node"]),
    (
        "outcome",
        &[
            "checkpoint",
            "goodput",
            "metrics",
            "node",
            "notice",
            "responder",
            "webhook",
        ],
    ),
    (
        "app",
        &[
            "admin",
            "backoff",
            "checkpoint",
            "config",
            "goodput",
            "gpu",
            "life",
            "metrics",
            "node",
            "notice",
            "outcome",
            "prefetch",
            "relay",
            "responder",
            "store",
            "upload",
            "webhook",
        ],
    ),
    (
        "drill",
        &[
            "app",
            "checkpoint",
            "config",
            "duration",
            "emulator",
            "fsutil",
            "goodput",
            "notice",
            "responder",
            "telemetry",
            "units",
            "upload",
        ],
    ),
    (
        "cli",
        &[
            "config", "drill", "emulator", "fsutil", "goodput", "gpu", "prefetch", "relay",
            "store", "upload",
        ],
    ),
];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn allowed() -> Graph {
    ALLOWED
        .iter()
        .map(|(m, to)| (m.to_string(), to.iter().map(|s| s.to_string()).collect()))
        .collect()
}

/// The source without its comments (`//` to the end of the line, `/* … */`). String literals
/// stay: `#[serde(with = "crate::duration::serde_str")]` is an import too.
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
    }
    out.push_str(rest);
    out.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The top-level modules one file names through `crate::`: `crate::x::…`, `crate::x`,
/// `use crate::{x, y::z}`.
fn imports_of(src: &str) -> BTreeSet<String> {
    let src = strip_comments(src);
    let mut found = BTreeSet::new();
    let mut at = 0;
    while let Some(i) = src[at..].find("crate::") {
        let start = at + i;
        at = start + "crate::".len();
        let before = src[..start].chars().next_back();
        if before.is_some_and(|c| is_ident(c) || c == '$') {
            continue;
        }
        let rest = &src[at..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item = String::new();
            let mut first = true;
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if !item.is_empty() {
                            found.insert(std::mem::take(&mut item));
                        }
                        first = true;
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 && first {
                    if is_ident(c) {
                        item.push(c);
                    } else if !item.is_empty() {
                        found.insert(std::mem::take(&mut item));
                        first = false;
                    }
                }
            }
            if !item.is_empty() {
                found.insert(item);
            }
        } else {
            let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            if name.starts_with(|c: char| c.is_ascii_lowercase()) {
                found.insert(name);
            }
        }
    }
    found.retain(|m| m != "self");
    found
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every top-level module of the library and the modules it imports (itself left out).
fn actual() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph = Graph::new();
    for file in files {
        let rel = file.strip_prefix(&src).expect("under src");
        let first = rel.components().next().expect("a component");
        let top = first.as_os_str().to_string_lossy();
        let top = top.strip_suffix(".rs").unwrap_or(&top).to_string();
        // lib.rs declares the modules; main.rs is the binary, a crate of its own.
        if top == "lib" || top == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read source");
        let entry = graph.entry(top.clone()).or_default();
        entry.extend(imports_of(&text).into_iter().filter(|m| *m != top));
    }
    graph
}

fn cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        graph: &Graph,
        node: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == node) {
            let mut c = path[i..].to_vec();
            c.push(node.to_string());
            return Some(c);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(graph, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(graph, n, &mut Vec::new(), &mut done))
}

#[test]
fn every_import_between_top_level_modules_points_the_allowed_way() {
    let allowed = allowed();
    let mut against = Vec::new();
    for (module, imports) in actual() {
        let ok = allowed.get(&module);
        for to in imports {
            if !ok.is_some_and(|ok| ok.contains(&to)) {
                against.push(format!("{module} -> {to}"));
            }
        }
    }
    assert!(
        against.is_empty(),
        "imports not in tests/architecture.rs ALLOWED (move what they need down, or add the \
         arrow there and in docs/architecture.md if it is the right way): {against:?}"
    );
}

/// The table in docs/architecture.md, "Which way the arrows point": `| `a`, `b` | `x`, `y` |`
/// rows ("nothing of the crate's" is no arrow).
fn documented() -> Graph {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .expect("read docs/architecture.md");
    let section = doc
        .split("### Which way the arrows point")
        .nth(1)
        .expect("the section")
        .split("\n#")
        .next()
        .expect("its text");
    let names = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(String::from)
            .collect()
    };
    let mut graph = Graph::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() != 4 || cells[1] == "module" || cells[1].starts_with("---") {
            continue;
        }
        let to: BTreeSet<String> = names(cells[2]).into_iter().collect();
        for module in names(cells[1]) {
            graph.insert(module, to.clone());
        }
    }
    graph
}

#[test]
fn the_documented_arrows_are_the_allowed_ones() {
    assert_eq!(
        documented(),
        allowed(),
        "docs/architecture.md's arrow table and tests/architecture.rs ALLOWED differ"
    );
}

#[test]
fn the_allowed_arrows_have_no_cycle() {
    assert_eq!(cycle(&allowed()), None);
}

#[test]
fn every_top_level_module_has_a_row_and_every_row_a_module() {
    let modules: BTreeSet<String> = actual().into_keys().collect();
    let rows: BTreeSet<String> = allowed().into_keys().collect();
    assert_eq!(
        modules, rows,
        "tests/architecture.rs ALLOWED lists exactly the modules of src/"
    );
    for (_, to) in ALLOWED {
        for m in *to {
            assert!(
                modules.contains(*m),
                "ALLOWED names `{m}`, no module of src/"
            );
        }
    }
}

#[test]
fn notice_and_node_import_nothing_from_the_responder_and_node_nothing_above_it() {
    let graph = actual();
    for low in ["notice", "node"] {
        assert!(
            !graph[low].contains("responder"),
            "{low} imports the responder"
        );
    }
    for above in [
        "responder",
        "checkpoint",
        "gpu",
        "config",
        "app",
        "outcome",
        "upload",
    ] {
        assert!(!graph["node"].contains(above), "node imports {above}");
    }
}

#[test]
fn prefetch_and_upload_stand_on_the_store_and_never_import_each_other() {
    // Neither in the table (so a new import fails the first test) nor in the code.
    let allowed = allowed();
    let graph = actual();
    for (a, b) in [("prefetch", "upload"), ("upload", "prefetch")] {
        assert!(
            !allowed[a].contains(b),
            "ALLOWED lets {a} import {b}: what both need belongs in store/"
        );
        assert!(!graph[a].contains(b), "{a} imports {b}");
        assert!(graph[a].contains("store"), "{a} no longer uses store/");
    }
    // Only the command line joins the two (`prefetch --latest-checkpoint`); the store floor is
    // below both.
    assert!(graph["cli"].contains("prefetch") && graph["cli"].contains("upload"));
    assert!(!graph["store"].contains("prefetch") && !graph["store"].contains("upload"));
}

#[test]
fn the_scanner_reads_every_form_of_import_and_skips_comments() {
    let src = r#"
        use crate::alpha::Thing;
        use crate::{beta, gamma::{Deep, deeper::X}, self};
        //! doc naming crate::delta
        // crate::epsilon in a comment
        /* crate::zeta
           crate::eta */
        fn f() { crate::theta::call(); let _ = my_crate::iota::x; }
        #[serde(with = "crate::kappa::serde_str")]
        struct S;
        type T = crate::Upper;
    "#;
    let want: BTreeSet<String> = ["alpha", "beta", "gamma", "theta", "kappa"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(imports_of(src), want);
}

#[test]
fn a_back_arrow_is_a_cycle() {
    let mut graph = allowed();
    graph
        .get_mut("node")
        .expect("node row")
        .insert("responder".into());
    let c = cycle(&graph).expect("node -> responder closes a cycle");
    assert!(c.contains(&"node".to_string()) && c.contains(&"responder".to_string()));
}
