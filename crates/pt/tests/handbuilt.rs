//! Hand-built checkpoints (no Python needed): views and gather, names and skipped leaves, and
//! every kind of hostile or broken file, each a clear error naming what is wrong.

mod common;

use common::{hostile, small_state_dict, torch_zip, with_pickle, Pickle};
use turboio_pt::{Dtype, Limits, PtError, PtIndex, PtOptions};

fn parse(file: &[u8]) -> Result<PtIndex, PtError> {
    PtIndex::parse(file, &PtOptions::default())
}

fn err(file: &[u8]) -> String {
    match parse(file) {
        Ok(i) => panic!("accepted: {:?}", i.tensors()),
        Err(e) => e.to_string(),
    }
}

fn err_with(file: &[u8], opts: &PtOptions) -> String {
    match PtIndex::parse(file, opts) {
        Ok(i) => panic!("accepted: {:?}", i.tensors()),
        Err(e) => e.to_string(),
    }
}

fn f32s(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
}

fn gathered(file: &[u8], index: &PtIndex, name: &str) -> Vec<f32> {
    let t = index.tensor(name).unwrap();
    let span = index.file_span(t);
    let mut out = vec![0u8; t.nbytes() as usize];
    t.gather(&file[span.start as usize..span.end as usize], &mut out).unwrap();
    out.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn views_share_storage_and_gather_row_major() {
    // Storage 0..12 as f32. base (3, 4); t = base.t(); s = base[1:, ::2]; e = base[3:3];
    // z = 0-d view of element 7; x = expand of element 5 to (2, 3); w = zero-size dim with stride.
    let mut p = Pickle::new();
    p.op(b"}(");
    p.str("base").tensor("FloatStorage", "0", 12, 0, &[3, 4], &[4, 1]);
    p.str("t").tensor("FloatStorage", "0", 12, 0, &[4, 3], &[1, 4]);
    p.str("s").tensor("FloatStorage", "0", 12, 4, &[2, 2], &[4, 2]);
    p.str("e").tensor("FloatStorage", "0", 12, 12, &[0, 4], &[4, 1]);
    p.str("z").tensor("FloatStorage", "0", 12, 7, &[], &[]);
    p.str("x").tensor("FloatStorage", "0", 12, 5, &[2, 3], &[0, 0]);
    p.str("w").tensor("FloatStorage", "0", 12, 2, &[2, 0, 3], &[6, 3, 1]);
    p.op(b"u");
    let file = with_pickle(&p.stop(), &[("0", &f32s(12))]);
    let index = parse(&file).unwrap();
    assert_eq!(index.storages().len(), 1);
    assert!(index.tensors().iter().all(|t| t.storage == 0 && t.dtype == Dtype::F32));
    let base: Vec<f32> = (0..12).map(|i| i as f32).collect();
    assert_eq!(gathered(&file, &index, "base"), base);
    let t: Vec<f32> = (0..4).flat_map(|c| (0..3).map(move |r| (r * 4 + c) as f32)).collect();
    assert_eq!(gathered(&file, &index, "t"), t);
    assert_eq!(gathered(&file, &index, "s"), vec![4.0, 6.0, 8.0, 10.0]);
    assert_eq!(gathered(&file, &index, "e"), Vec::<f32>::new());
    assert_eq!(gathered(&file, &index, "z"), vec![7.0]);
    assert_eq!(gathered(&file, &index, "x"), vec![5.0; 6]);
    assert_eq!(gathered(&file, &index, "w"), Vec::<f32>::new());

    let contiguous: Vec<(&str, bool)> = index.tensors().iter().map(|t| (t.name.as_str(), t.is_contiguous())).collect();
    assert_eq!(
        contiguous,
        [("base", true), ("t", false), ("s", false), ("e", true), ("z", true), ("x", false), ("w", true)]
    );
    let spans: Vec<_> = index.tensors().iter().map(|t| t.byte_span()).collect();
    assert_eq!(spans, [0..48, 0..48, 16..44, 48..48, 28..32, 20..24, 8..8]);
    let st = &index.storages()[0];
    assert_eq!((st.numel, st.len, st.offset % 64), (12, 48, 0));
    assert_eq!(&file[st.file_range().start as usize..st.file_range().end as usize], &f32s(12)[..]);

    // Wrong buffer sizes are errors, not panics.
    let t = index.tensor("t").unwrap();
    assert!(t.gather(&[0; 47], &mut [0; 48]).is_err());
    assert!(t.gather(&[0; 48], &mut [0; 47]).is_err());
}

#[test]
fn names_flatten_and_leaves_are_skipped() {
    let mut p = Pickle::new();
    p.op(b"}(").str("model").op(b"}(").str("w").tensor("HalfStorage", "a", 2, 0, &[2], &[1]).op(b"u");
    p.str("step").int(7).str("cfg").op(b"}(").str("lr").op(b"G\x3f\xe0\0\0\0\0\0\0").str("name").str("x");
    p.str("none").op(b"Nu");
    p.str("list").op(b"](").tensor("HalfStorage", "a", 2, 1, &[1], &[1]).op(b"\x88e");
    p.int(3).tensor("HalfStorage", "a", 2, 0, &[], &[]).op(b"u");
    let file = with_pickle(&p.stop(), &[("a", &[1, 2, 3, 4])]);
    let index = parse(&file).unwrap();
    let names: Vec<&str> = index.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["model.w", "list.0", "3"]);
    let skipped: Vec<(&str, &str)> = index.skipped().iter().map(|s| (s.name.as_str(), s.kind)).collect();
    assert_eq!(
        skipped,
        [("step", "int"), ("cfg.lr", "float"), ("cfg.name", "str"), ("cfg.none", "None"), ("list.1", "bool")]
    );

    let index = PtIndex::parse(file.as_slice(), &PtOptions::with_top_level_key("model")).unwrap();
    assert_eq!(index.tensors().iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["w"]);
    assert!(index.skipped().is_empty());
    let e = err_with(&file, &PtOptions::with_top_level_key("state_dict"));
    assert!(e.contains("`state_dict` not found") && e.contains("`model`, `step`, `cfg`"), "{e}");

    // Allow-listed globals pushed and never called (torch's reader returns the objects): leaves
    // named as such, nothing called.
    let mut p = Pickle::new();
    p.op(b"}(").str("dt").global("torch", "float32").str("fn").global("torch._utils", "_rebuild_tensor_v2");
    p.str("cls").global("torch", "FloatStorage").op(b"u");
    let index = parse(&with_pickle(&p.stop(), &[])).unwrap();
    assert!(index.tensors().is_empty());
    let kinds: Vec<&str> = index.skipped().iter().map(|s| s.kind).collect();
    assert_eq!(kinds, ["class or function"; 3]);
}

#[test]
fn parameters_v3_and_from_type() {
    // _rebuild_parameter(_rebuild_tensor_v3(untyped, ..., torch.uint16), True, OrderedDict())
    let mut p = Pickle::new();
    p.op(b"}(").str("p").global("torch._utils", "_rebuild_parameter").op(b"(");
    p.global("torch._utils", "_rebuild_tensor_v3").op(b"((");
    p.str("storage").global("torch.storage", "UntypedStorage").str("0").str("cpu").int(8).op(b"tQ");
    p.int(1).ints(&[3]).ints(&[1]).op(b"\x89").global("collections", "OrderedDict").op(b")R");
    p.global("torch", "uint16").op(b"tR\x88").global("collections", "OrderedDict").op(b")RtR");
    // _rebuild_from_type_v2(_rebuild_tensor_v2, Parameter, (args), {})
    p.str("q").global("torch._tensor", "_rebuild_from_type_v2").op(b"(");
    p.global("torch._utils", "_rebuild_tensor_v2").global("torch.nn.parameter", "Parameter").op(b"(");
    p.op(b"(").str("storage").global("torch", "BFloat16Storage").str("1").str("cuda:0").int(2).op(b"tQ");
    p.int(0).ints(&[2]).ints(&[1]).op(b"\x88").global("collections", "OrderedDict").op(b")Rt}tRu");
    let file = with_pickle(&p.stop(), &[("0", &[0, 0, 1, 0, 2, 0, 3, 0]), ("1", &[0, 0x3f, 0x80, 0x3f])]);
    let index = parse(&file).unwrap();
    let p = index.tensor("p").unwrap();
    assert_eq!((p.dtype, p.storage_offset, p.is_parameter, p.requires_grad), (Dtype::U16, 1, true, true));
    assert_eq!(index.storage_of(p).numel, 4);
    let q = index.tensor("q").unwrap();
    assert_eq!((q.dtype, q.is_parameter, q.requires_grad), (Dtype::BF16, true, true));
    assert_eq!(index.storage_of(q).location, "cuda:0");
}

#[test]
fn module_metadata_build_is_accepted() {
    // OrderedDict() with tensors, then BUILD({'_metadata': OrderedDict(...)}).
    let mut p = Pickle::new();
    p.global("collections", "OrderedDict").op(b"q\x00)R(").str("w").tensor("FloatStorage", "0", 1, 0, &[1], &[1]);
    p.op(b"u}").str("_metadata").op(b"h\x00)R(").str("").op(b"}").str("version").int(1).op(b"susb");
    let file = with_pickle(&p.stop(), &[("0", &f32s(1))]);
    let index = parse(&file).unwrap();
    assert_eq!(index.tensors().len(), 1);
    assert!(index.skipped().is_empty());
}

#[test]
fn hostile_globals_and_calls_are_refused_and_nothing_runs() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("pwned");
    let cmd = format!("touch {}", marker.display());
    let call = |module: &str, name: &str, arg: &str| {
        let mut p = Pickle::new();
        p.op(b"}").str("w").global(module, name).str(arg).op(b"\x85Rs");
        with_pickle(&p.stop(), &[])
    };
    let cases = [
        (call("posix", "system", &cmd), "global posix.system"),
        (call("os", "system", &cmd), "global os.system"),
        (call("builtins", "eval", &format!("__import__('os').system('{cmd}')")), "global builtins.eval"),
        (call("builtins", "exec", &format!("open('{}','w')", marker.display())), "global builtins.exec"),
        (call("subprocess", "check_call", &cmd), "global subprocess.check_call"),
        (call("torch", "load", "x"), "global torch.load"),
        (call("torch._utils", "_rebuild_qtensor", "x"), "global torch._utils._rebuild_qtensor"),
        (call("collections", "OrderedDict", "x"), "collections.OrderedDict called with arguments"),
        (call("torch", "FloatStorage", "x"), "calling torch.FloatStorage"),
        (call("torch", "Tensor", "x"), "calling torch.Tensor"),
    ];
    for (file, words) in &cases {
        let e = err(file);
        assert!(e.contains(words) && e.contains("nothing was executed"), "`{e}` lacks `{words}`");
        assert!(e.starts_with("pickle byte "), "{e}");
    }
    // STACK_GLOBAL (protocol 4) is resolved by the same allow-list.
    let mut p = Pickle::new();
    p.str("os").str("system").op(&[0x93]).str(&cmd).op(b"\x85R");
    assert!(err(&with_pickle(&p.stop(), &[])).contains("global os.system"));
    // REDUCE of something that is not a global; BUILD of a tensor; INST / OBJ / NEWOBJ.
    let mut p = Pickle::new();
    p.op(b"})R");
    assert!(err(&with_pickle(&p.stop(), &[])).contains("REDUCE of a dict"));
    let mut p = Pickle::new();
    p.tensor("FloatStorage", "0", 1, 0, &[1], &[1]).op(b"}b");
    assert!(err(&with_pickle(&p.stop(), &[("0", &f32s(1))])).contains("BUILD of a tensor"));
    for (op, name) in [(&b"iposix\nsystem\n"[..], "INST"), (b"(o", "OBJ"), (b"\x81", "NEWOBJ"), (b"\x82\x01", "EXT1")] {
        let mut p = Pickle::new();
        p.op(op);
        let e = err(&with_pickle(&p.stop(), &[]));
        assert!(e.contains(&format!("opcode {name} ")), "{e}");
    }
    let mut p = Pickle::new();
    p.op(b"\xff");
    assert!(err(&with_pickle(&p.stop(), &[])).contains("unknown opcode (0xff)"));
    // Persistent ids other than torch's storages.
    let mut p = Pickle::new();
    p.op(b"(").str("module").str("a").str("b").str("c").str("d").op(b"tQ");
    assert!(err(&with_pickle(&p.stop(), &[])).contains("tag is not 'storage'"));
    let mut p = Pickle::new();
    p.str("x").op(b"Q");
    assert!(err(&with_pickle(&p.stop(), &[])).contains("persistent id of a str"));
    assert!(!marker.exists(), "a payload ran");
}

/// Offsets of the central directory records, in order.
fn central_records(zip: &[u8]) -> Vec<usize> {
    zip.windows(4).enumerate().filter(|(_, w)| *w == b"PK\x01\x02").map(|(i, _)| i).collect()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn set_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn broken_containers_are_refused() {
    let (pkl, data) = small_state_dict();
    let good = with_pickle(&pkl, &[("0", &data)]);
    assert_eq!(parse(&good).unwrap().tensors().len(), 2);
    let cds = central_records(&good);
    assert_eq!(cds.len(), 4); // data.pkl, byteorder, data/0, version

    // Two entries whose local headers coincide.
    let mut bad = good.clone();
    let first = u32_at(&bad, cds[0] + 42);
    set_u32(&mut bad, cds[2] + 42, first);
    let e = err(&bad);
    assert!(e.contains("overlap"), "{e}");

    // An entry whose data runs into the next record.
    let mut bad = good.clone();
    let size = u32_at(&bad, cds[1] + 20) + 100;
    set_u32(&mut bad, cds[1] + 20, size);
    set_u32(&mut bad, cds[1] + 24, size);
    let e = err(&bad);
    assert!(e.contains("overlap") && e.contains("byteorder"), "{e}");

    // An entry past the end of the file.
    let mut bad = good.clone();
    set_u32(&mut bad, cds[2] + 20, 0x7FFF_0000);
    set_u32(&mut bad, cds[2] + 24, 0x7FFF_0000);
    let e = err(&bad);
    assert!(e.contains("past the end of the file") && e.contains("data/0"), "{e}");

    // A compressed entry (method 8, deflate).
    let mut bad = good.clone();
    bad[cds[2] + 10] = 8;
    let e = err(&bad);
    assert!(e.contains("compressed") && e.contains("data/0"), "{e}");

    // A storage record shorter or longer than its numel (torch checks the size exactly), and a
    // view past its storage.
    let e = err(&with_pickle(&pkl, &[("0", &data[..16])]));
    assert!(e.contains("tensor `w`") && e.contains("record size (16 bytes) does not match"), "{e}");
    let longer: Vec<u8> = data.iter().chain(&[0u8; 8]).copied().collect();
    let e = err(&with_pickle(&pkl, &[("0", &longer)]));
    assert!(e.contains("record size (32 bytes) does not match expected size (24 bytes"), "{e}");
    let mut p = Pickle::new();
    p.op(b"}(").str("v").tensor("FloatStorage", "0", 6, 4, &[2], &[2]).op(b"u");
    let e = err(&with_pickle(&p.stop(), &[("0", &data)]));
    assert!(e.contains("tensor `v`") && e.contains("shorter than the tensor claims"), "{e}");

    // The storage record is missing; two dtypes on one storage; two tensors with one name.
    let e = err(&with_pickle(&pkl, &[]));
    assert!(e.contains("`data/0` is not in the archive"), "{e}");
    let mut p = Pickle::new();
    p.op(b"}(").str("a").tensor("FloatStorage", "0", 6, 0, &[1], &[1]);
    p.str("b").tensor("IntStorage", "0", 6, 0, &[1], &[1]).op(b"u");
    let e = err(&with_pickle(&p.stop(), &[("0", &data)]));
    assert!(e.contains("viewed as both F32 and I32"), "{e}");
    let mut p = Pickle::new();
    p.op(b"}(").str("a.b").tensor("FloatStorage", "0", 6, 0, &[1], &[1]);
    p.str("a").op(b"}").str("b").tensor("FloatStorage", "0", 6, 0, &[1], &[1]).op(b"su");
    let e = err(&with_pickle(&p.stop(), &[("0", &data)]));
    assert!(e.contains("tensor `a.b`: two tensors have this name"), "{e}");

    // Not a checkpoint: legacy, a bare pickle, TorchScript, nothing, garbage, two top-level dirs.
    let mut legacy = vec![0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
    legacy.extend_from_slice(b".");
    let e = err(&legacy);
    assert!(e.contains("legacy (pre-1.6)") && e.contains("torch.save(torch.load(f, weights_only=True), f2)"), "{e}");
    assert!(err(&pkl).contains("bare pickle"));
    let ts = torch_zip(&[("data.pkl", &pkl), ("constants.pkl", b"\x80\x02)."), ("code/__torch__.py", b"")]);
    assert!(err(&ts).contains("TorchScript"));
    assert!(err(b"").contains("not a torch.save checkpoint"));
    assert!(err(&[7u8; 1000]).contains("not a torch.save checkpoint"));
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    w.start_file("a/data.pkl", opts).unwrap();
    std::io::Write::write_all(&mut w, &pkl).unwrap();
    w.start_file("b/data/0", opts).unwrap();
    let e = err(&w.finish().unwrap().into_inner());
    assert!(e.contains("outside the archive's top-level directory"), "{e}");
    let e = err(&torch_zip(&[("data.pkl", &pkl), ("byteorder", b"middle"), ("data/0", &data)]));
    assert!(e.contains("byteorder record"), "{e}");
}

fn limits(f: impl FnOnce(&mut Limits)) -> PtOptions {
    let mut o = PtOptions::default();
    f(&mut o.limits);
    o
}

#[test]
fn bombs_hit_limits_or_fail_fast() {
    // 100k nested MARKs.
    let mut p = Pickle::new();
    p.op(&[b'('; 100_000]);
    let e = err(&with_pickle(&p.stop(), &[]));
    assert!(e.contains("max_depth") && e.contains("limit of 256"), "{e}");
    // 100k nested lists built without MARKs: caught when naming tensors.
    let mut p = Pickle::new();
    p.op(&[b']'; 100_000]).op(&[b'a'; 99_999]);
    let e = err(&with_pickle(&p.stop(), &[]));
    assert!(e.contains("nesting of containers") && e.contains("max_depth"), "{e}");
    // A list that contains itself.
    let mut p = Pickle::new();
    p.op(b"]q\x00h\x00a");
    assert!(err(&with_pickle(&p.stop(), &[])).contains("cycle"));
    // 2^100 paths through 100 shared lists.
    let mut p = Pickle::new();
    p.op(b"]");
    for _ in 0..100 {
        p.op(b"q\x00]h\x00ah\x00a");
    }
    let file = with_pickle(&p.stop(), &[]);
    let e = err(&file);
    assert!(e.contains("max_name_fanout") && e.contains("shared containers"), "{e}");
    let e = err_with(&file, &limits(|l| (l.max_items, l.max_name_fanout) = (3000, u64::MAX)));
    assert!(e.contains("max_items") && e.contains("3000"), "{e}");
    // Sharing that is not a bomb is named under every path.
    let mut p = Pickle::new();
    p.op(b"}(").str("model").op(b"}(").str("w").tensor("FloatStorage", "0", 1, 0, &[1], &[1]).op(b"uq\x07");
    p.str("ema").op(b"h\x07u");
    let index = parse(&with_pickle(&p.stop(), &[("0", &f32s(1))])).unwrap();
    let names: Vec<&str> = index.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["model.w", "ema.w"]);
    // Huge length fields.
    for op in [&b"\x8d\0\0\0\0\0\0\0\x40"[..], b"X\xff\xff\xff\xff", b"B\xff\xff\xff\x7f"] {
        let mut p = Pickle::new();
        p.op(op);
        let e = err(&with_pickle(&p.stop(), &[]));
        assert!(e.contains("but the pickle ends"), "{e}");
    }
    let mut p = Pickle::new();
    p.op(b"\x8a\x09\x01\x01\x01\x01\x01\x01\x01\x01\x01");
    assert!(err(&with_pickle(&p.stop(), &[])).contains("does not fit in 64 bits"));
    // Stack, memo and pickle size limits.
    let mut p = Pickle::new();
    p.op(&[b'N'; 2000]);
    let e = err_with(&with_pickle(&p.stop(), &[]), &limits(|l| l.max_stack = 1000));
    assert!(e.contains("max_stack"), "{e}");
    let mut p = Pickle::new();
    p.op(b"N");
    for i in 0..2000u32 {
        p.op(b"r").op(&i.to_le_bytes());
    }
    let e = err_with(&with_pickle(&p.stop(), &[]), &limits(|l| l.max_memo = 1000));
    assert!(e.contains("max_memo"), "{e}");
    let (pkl, data) = small_state_dict();
    let e = err_with(&with_pickle(&pkl, &[("0", &data)]), &limits(|l| l.max_pickle_bytes = 100));
    assert!(e.contains("max_pickle_bytes") && e.contains("data.pkl"), "{e}");
    // Malformed: no STOP, STOP on an empty stack, odd SETITEMS, MEMO read before write.
    for (bytes, words) in [
        (&b"\x80\x02N"[..], "without STOP"),
        (b"\x80\x02.", "empty stack"),
        (b"\x80\x02}(Nu.", "odd number"),
        (b"\x80\x02h\x05.", "memo entry 5"),
        (b"\x80\x09N.", "protocol 9"),
    ] {
        let e = err(&with_pickle(bytes, &[]));
        assert!(e.contains(words), "{e}");
    }
}

#[test]
fn duplicate_names_and_moved_directories_are_refused() {
    let (pkl, data) = small_state_dict();
    let other: Vec<u8> = data.iter().map(|b| b ^ 0xff).collect();
    let good = with_pickle(&pkl, &[("0", &data), ("1", &other)]);
    assert_eq!(parse(&good).unwrap().tensors().len(), 2);
    // `data/1` renamed to `data/0` in its local header and its directory entry: the zip crate
    // would keep the last `data/0` (other bytes than torch reads).
    let mut dup = good.clone();
    let from = b"archive/data/1";
    let spots: Vec<usize> = dup.windows(from.len()).enumerate().filter(|(_, w)| *w == from).map(|(i, _)| i).collect();
    assert_eq!(spots.len(), 2, "a local header and a directory entry");
    for at in spots {
        dup[at..at + from.len()].copy_from_slice(b"archive/data/0");
    }
    let e = err(&dup);
    assert!(e.contains("two entries are named `archive/data/0`"), "{e}");
    // Bytes after the end-of-central-directory record (a comment, or stacked records).
    let mut trailing = good.clone();
    trailing.extend_from_slice(b"trailing bytes");
    assert!(err(&trailing).contains("not the last 22 bytes"));
    let eocd = good[good.len() - 22..].to_vec();
    let mut stacked = good.clone();
    for _ in 0..5 {
        stacked.extend_from_slice(&eocd);
    }
    stacked.extend_from_slice(b"x");
    assert!(err(&stacked).contains("not the last 22 bytes"));
}

#[test]
fn stacked_directory_records_take_linear_time() {
    // Thousands of end-of-central-directory records, each pointing at a directory that does
    // not parse: the zip crate's backward search used to retry from each (minutes for 1.4 MB).
    let (pkl, data) = small_state_dict();
    let good = with_pickle(&pkl, &[("0", &data)]);
    let mut eocd = good[good.len() - 22..].to_vec();
    eocd[16..20].copy_from_slice(&0u32.to_le_bytes()); // directory at offset 0: not a directory
    let mut bomb = good[..good.len() - 22].to_vec();
    for _ in 0..60_000 {
        bomb.extend_from_slice(&eocd);
    }
    let start = std::time::Instant::now();
    let e = err(&bomb);
    // Generous for a debug build on a busy CI machine; the quadratic search took minutes.
    assert!(start.elapsed() < std::time::Duration::from_secs(10), "{:?}", start.elapsed());
    assert!(e.contains("central directory"), "{e}");
}

#[test]
fn long_names_over_many_leaves_hit_a_byte_bound() {
    // {'A' * 200_000: [None] * 200_000}: 400 KB pickled; naming every None would build 40 GB of
    // names ("AAAA....0", "AAAA....1", ...).
    let mut p = Pickle::new();
    p.op(b"}(").str(&"A".repeat(200_000)).op(b"](").op(&[b'N'; 200_000]).op(b"eu");
    let file = with_pickle(&p.stop(), &[]);
    assert!(file.len() < 500_000);
    let start = std::time::Instant::now();
    let e = err(&file);
    assert!(e.contains("max_name_bytes"), "{e}");
    assert!(start.elapsed() < std::time::Duration::from_secs(10), "{:?}", start.elapsed());
    // Ordinary names stay far below the bound.
    let mut p = Pickle::new();
    p.op(b"}(").str("model").op(b"](").op(&[b'N'; 1000]).op(b"eu");
    parse(&with_pickle(&p.stop(), &[])).unwrap();
}

#[test]
fn objects_made_and_dropped_hit_a_byte_bound() {
    // One dict key set over and over to a new list (or dict): every replaced value stays in
    // the arena (the VM never frees: the memo or a container may still hold an object), so only
    // a byte budget stops this; the count limits alone let a 32 MB pickle reach 1.4 GB. A small
    // budget shows the bound names itself.
    let mut opts = PtOptions::default();
    opts.limits.max_unpickled_bytes = 1 << 20;
    for op in [b']', b'}', b')'] {
        let e = err_with(&hostile::made_and_dropped(op, 100_000), &opts);
        assert!(e.contains("max_unpickled_bytes"), "{}: {e}", op as char);
    }
    // Empty tuples are immutable and made once: a million of them in a list cost a list slot
    // each (16 MB), far below a budget that one object each would exceed.
    opts.limits.max_unpickled_bytes = 24 << 20;
    let idx = PtIndex::parse(hostile::empty_tuples(1_000_000).as_slice(), &opts).unwrap();
    assert_eq!(idx.tensors().len(), 0);
    // An ordinary state dict fits a budget far below the default.
    opts.limits.max_unpickled_bytes = 1 << 20;
    let (pkl, data) = small_state_dict();
    PtIndex::parse(&with_pickle(&pkl, &[("0", &data)]), &opts).unwrap();
}
