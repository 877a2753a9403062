//! The two checksums every uploaded byte goes through, computed while it is read: CRC-64/NVME
//! (what S3 keeps for every new object) and CRC-32C (what GCS keeps). Parts are checksummed on
//! their own, in parallel, and combined in order (`crc(A‖B)` from `crc(A)`, `crc(B)` and
//! `len(B)`), so a file is never read twice.

use crc_fast::CrcAlgorithm;
use serde::{Deserialize, Serialize};

/// Checksums of a run of bytes, with its length (needed to combine).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Crcs {
    pub crc64nvme: u64,
    pub crc32c: u32,
    pub len: u64,
}

/// Bytes hashed per step: both digests run over one L2-sized chunk before the next, so the data
/// crosses the memory bus once.
const CHUNK: usize = 256 << 10;

impl Crcs {
    /// Of nothing (the start of a file).
    pub fn empty() -> Crcs {
        Crcs::of(&[])
    }

    /// Of `data`.
    pub fn of(data: &[u8]) -> Crcs {
        let mut d64 = crc_fast::Digest::new(CrcAlgorithm::Crc64Nvme);
        let mut d32 = crc_fast::Digest::new(CrcAlgorithm::Crc32Iscsi);
        for chunk in data.chunks(CHUNK) {
            d64.update(chunk);
            d32.update(chunk);
        }
        Crcs {
            crc64nvme: d64.finalize(),
            crc32c: d32.finalize() as u32,
            len: data.len() as u64,
        }
    }

    /// The checksums of `self` followed by `next`.
    pub fn then(self, next: Crcs) -> Crcs {
        Crcs {
            crc64nvme: crc_fast::checksum_combine(
                CrcAlgorithm::Crc64Nvme,
                self.crc64nvme,
                next.crc64nvme,
                next.len,
            ),
            crc32c: crc_fast::checksum_combine(
                CrcAlgorithm::Crc32Iscsi,
                u64::from(self.crc32c),
                u64::from(next.crc32c),
                next.len,
            ) as u32,
            len: self.len + next.len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_combine_into_the_whole_and_match_the_check_values() {
        let whole = Crcs::of(b"123456789");
        // The catalogued check values of CRC-32C and CRC-64/NVME.
        assert_eq!(whole.crc32c, 0xe306_9283);
        assert_eq!(whole.crc64nvme, 0xae8b_1486_0a79_9888);
        let data: Vec<u8> = (0..700_001u32).map(|i| (i * 31 % 253) as u8).collect();
        let combined = data
            .chunks(100_003)
            .map(Crcs::of)
            .fold(Crcs::empty(), Crcs::then);
        assert_eq!(combined, Crcs::of(&data));
    }
}
