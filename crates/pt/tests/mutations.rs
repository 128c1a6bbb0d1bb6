//! Random damage to valid checkpoints never panics or hangs: every result is a clean error or an
//! index whose every view lies inside the file and gathers.

mod common;

use common::{with_pickle, Pickle};
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
        let mut out = vec![0u8; t.nbytes() as usize];
        t.gather(&file[span.start as usize..span.end as usize], &mut out).unwrap();
    }
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
