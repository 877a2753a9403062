//! `loader_pages::release` unmaps this executable's relocation table (an integration test is a
//! position-independent executable with one, like the agent) and nothing else, and the process
//! goes on: its pages read back from `/proc/self/pagemap` (the "present" bit, readable for one's
//! own process without privileges).

use std::fs::File;
use std::os::unix::fs::FileExt;

use spotguard::loader_pages::{release, Released};

/// How many of the pages of `[start, start + len)` are mapped in this process.
fn present_pages(start: usize, len: usize) -> usize {
    let page = rustix::param::page_size();
    let pagemap = File::open("/proc/self/pagemap").expect("pagemap");
    let mut buf = vec![0u8; len / page * 8];
    pagemap
        .read_exact_at(&mut buf, (start / page * 8) as u64)
        .expect("reading pagemap");
    buf.chunks_exact(8)
        .filter(|e| u64::from_ne_bytes((*e).try_into().unwrap()) & (1 << 63) != 0)
        .count()
}

/// The executable's first mapping (the read-only segment the table lies in): `(start, end)`.
fn first_mapping() -> (usize, usize) {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let line = maps
        .lines()
        .find(|l| l.ends_with(exe.to_str().unwrap()))
        .expect("the executable's mapping");
    let (range, _) = line.split_once(' ').unwrap();
    let (a, b) = range.split_once('-').unwrap();
    (
        usize::from_str_radix(a, 16).unwrap(),
        usize::from_str_radix(b, 16).unwrap(),
    )
}

#[test]
fn the_relocation_table_is_unmapped_and_nothing_else() {
    let page = rustix::param::page_size();
    let (seg_start, seg_end) = first_mapping();
    // The loader read the whole table before main: every page of it is mapped. Find the table
    // first without touching it: release once, then map it back by reading it, and measure.
    let Released { start, len } = release().expect("release");
    assert!(
        start % page == 0 && len % page == 0 && len > 0,
        "{start:#x} {len}"
    );
    assert!(
        start >= seg_start && start + len <= seg_end,
        "{start:#x}+{len} outside the executable's first mapping {seg_start:#x}-{seg_end:#x}"
    );
    // SAFETY: the range is mapped, readable memory of this executable.
    let bytes = unsafe { std::slice::from_raw_parts(start as *const u8, len) };
    let sum: u64 = bytes.iter().step_by(page).map(|&b| u64::from(b)).sum();
    std::hint::black_box(sum);
    assert_eq!(
        present_pages(start, len),
        len / page,
        "read back, every page is mapped"
    );

    let head = start - seg_start;
    let head_mapped = present_pages(seg_start, head);
    assert!(
        head_mapped > 0,
        "the ELF header and dynamic symbols before the table are mapped"
    );
    let again = release().expect("release again");
    assert_eq!(again, Released { start, len });
    assert_eq!(
        present_pages(start, len),
        0,
        "after release, no page is mapped"
    );
    // The pages before it (the ELF header, the dynamic symbols) are left alone, and the
    // relocated data the table filled in is intact: formatting goes through a vtable.
    assert_eq!(present_pages(seg_start, head), head_mapped);
    let shown: Box<dyn std::fmt::Display> = Box::new(len);
    assert_eq!(format!("{shown}"), len.to_string());
}
