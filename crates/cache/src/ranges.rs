//! The byte ranges of an object already written to its cache file.

/// Sorted, disjoint, non-adjacent half-open ranges.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    /// Adds `start..end`, merging with what it touches.
    pub(crate) fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        // The first range that ends at or after `start`, and the first that starts after `end`.
        let lo = self.0.partition_point(|&(_, e)| e < start);
        let hi = self.0.partition_point(|&(s, _)| s <= end);
        let (mut s, mut e) = (start, end);
        if lo < hi {
            s = s.min(self.0[lo].0);
            e = e.max(self.0[hi - 1].1);
        }
        self.0.splice(lo..hi, [(s, e)]);
    }

    /// Bytes covered.
    pub(crate) fn covered(&self) -> u64 {
        self.0.iter().map(|&(s, e)| e - s).sum()
    }

    /// The ranges of `0..len` not covered.
    pub(crate) fn gaps(&self, len: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = 0;
        for &(s, e) in &self.0 {
            if s >= len {
                break;
            }
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < len {
            out.push((at, len));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Ranges;

    #[test]
    fn ranges_merge_and_leave_the_right_gaps() {
        let mut r = Ranges::default();
        r.insert(10, 20);
        r.insert(30, 40);
        assert_eq!(r.gaps(50), vec![(0, 10), (20, 30), (40, 50)]);
        r.insert(20, 30); // adjacent on both sides: one range
        assert_eq!(r.0, vec![(10, 40)]);
        r.insert(5, 12);
        r.insert(38, 45);
        r.insert(0, 0);
        assert_eq!(r.0, vec![(5, 45)]);
        assert_eq!(r.covered(), 40);
        r.insert(0, 50);
        assert_eq!(r.gaps(50), vec![]);
        assert_eq!(r.covered(), 50);
    }

    #[test]
    fn random_inserts_cover_what_a_bitmap_covers() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..200 {
            let mut r = Ranges::default();
            let mut bits = [false; 97];
            for _ in 0..(next() % 12) {
                let a = next() % 97;
                let b = a + next() % (98 - a);
                r.insert(a, b);
                bits[a as usize..b as usize].iter_mut().for_each(|x| *x = true);
            }
            assert_eq!(r.covered(), bits.iter().filter(|b| **b).count() as u64);
            let mut gaps = vec![false; 97];
            for (s, e) in r.gaps(97) {
                gaps[s as usize..e as usize].iter_mut().for_each(|x| *x = true);
            }
            assert!(bits.iter().zip(&gaps).all(|(b, g)| b != g), "{r:?}");
        }
    }
}
