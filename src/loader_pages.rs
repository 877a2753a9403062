//! The executable's pages that only the dynamic loader reads, given back after start-up.
//!
//! The binary is position-independent, so before `main` the loader applies its relocation
//! table (`.rela.dyn`, about 0.6 MiB of this binary: one entry per pointer in `.data.rel.ro`
//! and friends). Nothing reads that table again: the binary is linked with `-z now`, so there is
//! no lazy binding, and the table is not the `.rela.plt` a lazy binder would read. Yet its pages
//! stay mapped, and counted in the process's RSS, for the life of the process.
//!
//! [`release`] unmaps them: `madvise(MADV_DONTNEED)` on the whole pages inside the table. The
//! table sits in the executable's read-only, private, file-backed first segment, which no one
//! writes, so dropping the mapping loses nothing: the pages stay in the page cache and a read
//! (there is none) would map them back. Called once at the start of every command
//! (`spotguard run`, the prefetcher, the `__pod-fs` helpers: the same binary), it takes the
//! agent's idle RSS down by the table's size; docs/architecture.md has the measurement.

use std::ffi::c_int;

/// What [`release`] gave back: the page-aligned range of the relocation table, unmapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    pub start: usize,
    pub len: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A static binary, or a loader this module does not know: nothing to give back.
    #[error("the executable has no dynamic relocation table in a read-only segment")]
    NoTable,
    /// The table is smaller than a page once aligned inward.
    #[error("the relocation table ({0} bytes) covers no whole page")]
    TooSmall(usize),
    #[error("madvise(MADV_DONTNEED) on the relocation table: {0}")]
    Madvise(std::io::Error),
}

const DT_NULL: i64 = 0;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;

/// An `Elf64_Dyn` entry of the dynamic section.
#[repr(C)]
struct Dyn {
    tag: i64,
    val: u64,
}

/// Where the main executable's relocation table is: `(address, size)`.
type Table = Option<(usize, usize)>;

/// Unmap the executable's relocation table (see the module's text). Idempotent.
pub fn release() -> Result<Released, Error> {
    let mut table: Table = None;
    // SAFETY: the callback only reads the program headers and the dynamic section the loader
    // hands it, while it runs; `data` is the `Table` above, alive for the whole call.
    unsafe {
        libc::dl_iterate_phdr(Some(main_program), (&mut table as *mut Table).cast());
    }
    let (addr, size) = table.ok_or(Error::NoTable)?;
    let page = rustix::param::page_size();
    let start = addr.next_multiple_of(page);
    let end = (addr + size) / page * page;
    if end <= start {
        return Err(Error::TooSmall(size));
    }
    // SAFETY: [start, end) lies inside a read-only, private, file-backed segment of this
    // executable that nothing writes (checked in `main_program`): dropping its pages only
    // unmaps them; a later read would fault them back unchanged.
    let rc = unsafe { libc::madvise(start as *mut _, end - start, libc::MADV_DONTNEED) };
    if rc != 0 {
        return Err(Error::Madvise(std::io::Error::last_os_error()));
    }
    Ok(Released {
        start,
        len: end - start,
    })
}

/// `dl_iterate_phdr`'s callback: the first object is the main program. Records its relocation
/// table when the table lies inside one of its read-only (not writable, not executable)
/// segments; stops after the first object.
unsafe extern "C" fn main_program(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    data: *mut std::ffi::c_void,
) -> c_int {
    // SAFETY: the loader passes a valid `dl_phdr_info` and our `Table`.
    let (info, table) = unsafe { (&*info, &mut *data.cast::<Table>()) };
    if info.dlpi_phdr.is_null() {
        return 1;
    }
    let base = info.dlpi_addr as usize;
    // SAFETY: `dlpi_phdr` points at `dlpi_phnum` program headers.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    let read_only: Vec<(usize, usize)> = phdrs
        .iter()
        .filter(|p| p.p_type == libc::PT_LOAD && p.p_flags & (libc::PF_W | libc::PF_X) == 0)
        .map(|p| (base + p.p_vaddr as usize, p.p_memsz as usize))
        .collect();
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == libc::PT_DYNAMIC) else {
        return 1;
    };
    let (mut rela, mut relasz) = (None, None);
    let entries = dynamic.p_memsz as usize / std::mem::size_of::<Dyn>();
    let first = (base + dynamic.p_vaddr as usize) as *const Dyn;
    for i in 0..entries {
        // SAFETY: the dynamic section is mapped and holds `entries` entries (it ends at DT_NULL).
        let d = unsafe { &*first.add(i) };
        match d.tag {
            DT_NULL => break,
            DT_RELA => rela = Some(d.val as usize),
            DT_RELASZ => relasz = Some(d.val as usize),
            _ => {}
        }
    }
    let (Some(rela), Some(size)) = (rela, relasz) else {
        return 1;
    };
    // glibc rewrites the main program's DT_RELA to an address when its dynamic section is
    // writable; another loader may leave the offset from the load base.
    let inside = |addr: usize| {
        read_only
            .iter()
            .any(|&(s, len)| addr >= s && addr.saturating_add(size) <= s + len)
    };
    *table = [rela, base.wrapping_add(rela)]
        .into_iter()
        .find(|&a| inside(a))
        .map(|a| (a, size));
    1
}
