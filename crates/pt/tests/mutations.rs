//! Random damage to valid checkpoints never panics or hangs: every result is a clean error or an
//! index whose every view lies inside the file and gathers.

mod common;

use common::{hostile, with_pickle, Pickle};
use proptest::prelude::*;
use turboio_pt::{PtIndex, PtOptions};

/// A checkpoint using most of what the VM accepts: nested dicts, lists, views, a parameter,
/// a v3 untyped storage, OrderedDict + BUILD, scalars.
fn rich() -> (Vec<u8>, Vec<(&'static str, Vec<u8>)>) {
    let mut p = Pickle::new();
    p.global("collections", "OrderedDict").op(b"q\x00)R(");
    p.str("a").tensor("FloatStorage", "0", 12, 0, &[3, 4], &[4, 1]);
    p.str("b").tensor("FloatStorage", "0", 12, 1, &[2, 2], &[1, 4]);
    p.str("c").op(b"](").tensor("HalfStorage", "1", 4, 0, &[], &[]).int(5).op(b"Ne");
    p.str("p").global("torch._utils", "_rebuild_parameter").op(b"(");
    p.global("torch._utils", "_rebuild_tensor_v3").op(b"((");
    p.str("storage").global("torch.storage", "UntypedStorage").str("2").str("cpu").int(8).op(b"tQ");
    p.int(0).ints(&[4]).ints(&[1]).op(b"\x89").global("collections", "OrderedDict").op(b")R");
    p.global("torch", "float8_e4m3fn").op(b"tR\x88h\x00)RtR");
    p.op(b"u}").str("_metadata").op(b"h\x00)Rsb");
    let storages = vec![
        ("0", (0..12).flat_map(|i| (i as f32).to_le_bytes()).collect()),
        ("1", vec![1, 2, 3, 4, 5, 6, 7, 8]),
        ("2", vec![9; 8]),
    ];
    (p.stop(), storages)
}

fn zip_of(pkl: &[u8], storages: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let refs: Vec<(&str, &[u8])> = storages.iter().map(|(k, d)| (*k, d.as_slice())).collect();
    with_pickle(pkl, &refs)
}

/// Parses and, when accepted, checks the index is self-consistent.
fn check(file: &[u8]) {
    let Ok(index) = PtIndex::parse(file, &PtOptions::default()) else { return };
    for t in index.tensors() {
        let span = index.file_span(t);
        assert!(span.start <= span.end && span.end <= file.len() as u64, "{}: span {span:?}", t.name);
        let st = index.storage_of(t);
        assert!(st.offset + st.len <= file.len() as u64);
        assert!(span.start >= st.offset && span.end <= st.offset + st.len);
        // Expanded views may describe far more bytes than are stored (conversions bound that);
        // gather the ones of a sane size.
        if t.nbytes() <= 64 << 20 {
            let mut out = vec![0u8; t.nbytes() as usize];
            t.gather(&file[span.start as usize..span.end as usize], &mut out).unwrap();
        }
    }
}

/// Parses with small limits, as a test can afford to hit them.
fn small_limits() -> PtOptions {
    let mut opts = PtOptions::default();
    opts.limits.max_name_bytes = 1 << 20;
    opts.limits.max_unpickled_bytes = 4 << 20;
    opts
}

#[test]
fn the_rich_checkpoint_is_valid() {
    let (pkl, storages) = rich();
    let file = zip_of(&pkl, &storages);
    let index = PtIndex::parse(file.as_slice(), &PtOptions::default()).unwrap();
    let names: Vec<&str> = index.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c.0", "p"]);
    assert_eq!(index.skipped().len(), 2);
    check(&file);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 768, ..ProptestConfig::default() })]

    #[test]
    fn byte_flips_in_the_file(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
                              cut in prop::option::of(any::<prop::sample::Index>())) {
        let (pkl, storages) = rich();
        let mut file = zip_of(&pkl, &storages);
        for (i, b) in flips {
            let at = i.index(file.len());
            file[at] = b;
        }
        if let Some(c) = cut {
            file.truncate(c.index(file.len()));
        }
        check(&file);
    }

    #[test]
    fn damage_to_the_pickle(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
                            cut in prop::option::of(any::<prop::sample::Index>()),
                            insert in prop::option::of((any::<prop::sample::Index>(), prop::collection::vec(any::<u8>(), 1..16)))) {
        let (mut pkl, storages) = rich();
        for (i, b) in flips {
            let at = i.index(pkl.len());
            pkl[at] = b;
        }
        if let Some((i, bytes)) = insert {
            let at = i.index(pkl.len());
            pkl.splice(at..at, bytes);
        }
        if let Some(c) = cut {
            pkl.truncate(c.index(pkl.len()));
        }
        check(&zip_of(&pkl, &storages));
    }

    #[test]
    fn random_pickles(pkl in prop::collection::vec(any::<u8>(), 0..256)) {
        let (_, storages) = rich();
        check(&zip_of(&pkl, &storages));
    }
}

// The hostile shapes of issue 22, with their parameters varied.
proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn duplicate_names_are_always_refused(flip in any::<u8>()) {
        let e = PtIndex::parse(hostile::duplicate_names(flip).as_slice(), &PtOptions::default()).unwrap_err().to_string();
        prop_assert!(e.contains("two entries are named"), "{}", e);
    }

    #[test]
    fn long_names_stay_within_their_byte_bound(key_len in 1usize..20_000, leaves in 0usize..3_000) {
        let file = hostile::long_names(key_len, leaves);
        let opts = small_limits();
        match PtIndex::parse(file.as_slice(), &opts) {
            // Every leaf's name is the key plus `.i`: accepted only if that fits the bound.
            Ok(_) => prop_assert!(((key_len + 6) * leaves) as u64 <= 2 * opts.limits.max_name_bytes),
            Err(e) => {
                let e = e.to_string();
                prop_assert!(e.contains("max_name_bytes"), "{}", e);
                prop_assert!((key_len * leaves) as u64 > opts.limits.max_name_bytes / 2, "{}", e);
            }
        }
        check(&file);
    }

    #[test]
    fn stacked_directory_records_are_refused(records in 1usize..2_000, dir_offset in any::<u32>()) {
        let file = hostile::stacked_directory_records(records, dir_offset);
        prop_assert!(PtIndex::parse(file.as_slice(), &PtOptions::default()).is_err());
    }

    #[test]
    fn expanded_views_stay_inside_their_storage(shape in prop::collection::vec(0i32..1 << 12, 0..4),
                                                strides in prop::collection::vec(0i32..2, 0..4)) {
        let strides: Vec<i32> = strides.into_iter().chain(std::iter::repeat(0)).take(shape.len()).collect();
        check(&hostile::expanded_view(&shape, &strides));
    }

    #[test]
    fn objects_made_and_dropped_stay_within_the_byte_bound(op in prop::sample::select(vec![b']', b'}', b')']),
                                                           pairs in 0usize..200_000) {
        let opts = small_limits();
        match PtIndex::parse(hostile::made_and_dropped(op, pairs).as_slice(), &opts) {
            Ok(index) => prop_assert!(index.tensors().is_empty()),
            Err(e) => {
                let e = e.to_string();
                prop_assert!(e.contains("max_unpickled_bytes"), "{}", e);
            }
        }
    }
}
