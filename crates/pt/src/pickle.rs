//! An allow-listed pickle virtual machine: it builds only the objects `torch.save` emits for
//! tensors and containers, and refuses everything else by name.
//!
//! Written by hand because no crate does this job: `serde-pickle` has no persistent ids (which
//! torch uses for every storage) and resolves unknown globals to `None` instead of refusing them,
//! and `pytorch-reader` (burn) does not expose the storages' byte offsets that mapped and
//! `O_DIRECT` loads need (see the crate docs).
//!
//! # What runs
//!
//! Nothing from the file is ever called. `GLOBAL`/`STACK_GLOBAL` resolve a `module name` pair
//! against a fixed table ([`Global`]) and fail on anything else; `REDUCE` applies one of the
//! table's rebuild functions, implemented here as plain data constructors; `BUILD` only accepts
//! a dict as target (OrderedDict's `__dict__`, e.g. nn.Module's `_metadata`), whose state is
//! dropped.
//!
//! The opcodes accepted are those of torch's own `weights_only` reader
//! (`torch/_weights_only_unpickler.py`) that containers and tensors need, plus the ones
//! `torch.save(..., pickle_protocol=4 or 5)` writes (`FRAME`, `MEMOIZE`, `STACK_GLOBAL`,
//! `SHORT_BINUNICODE`, `BINUNICODE8`, the `BINBYTES` family): torch can read such files only by
//! executing their pickle (`weights_only=False`), this VM reads them without executing anything
//! (see `ATTACKS.md`). Everything else is refused by name: `INST`, `OBJ`, `NEWOBJ`, `EXT*`, the
//! text opcodes, `POP`, `POP_MARK`, `DUP`, `LIST`, `DICT`, `BINSTRING`, `LONG4`, sets,
//! out-of-band buffers (no torch writer emits them, and torch's reader refuses them).
//!
//! # Bounded
//!
//! The VM is a loop, never recursive. Objects live in one arena addressed by index, so shared and
//! even cyclic structures cost nothing extra and drop without recursion. Every allocation is
//! bounded by the input size or a limit: stack, MARK nesting, memo entries and total container
//! items each have a cap that names itself when hit, and the bytes all of them hold together are
//! capped by [`Limits::max_unpickled_bytes`]: objects are never freed (a popped object may still
//! be referenced from the memo or a container), so a pickle that makes and drops millions of
//! objects (a dict key set again and again, memo slots rewritten) is stopped by that byte budget,
//! not by the machine's memory. The empty tuple is immutable and made once.

use crate::{Limits, PtError};
use std::collections::HashMap;
use turboio_format::Dtype;

/// Index of an object in the arena.
pub(crate) type Id = u32;

/// A value on the stack: scalars inline, everything else in the arena.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Val {
    None,
    Bool(bool),
    Int(i64),
    /// A float's value describes no tensor; only its presence is kept.
    Float,
    Obj(Id),
}

/// Element type of a storage or tensor: one safetensors has, or a torch name it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    Known(Dtype),
    /// Torch's name of a dtype safetensors cannot represent (e.g. `complex128`).
    Unsupported(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StorageType {
    /// `torch.FloatStorage` etc.: numel counts elements of this type.
    Typed(Elem, &'static str),
    /// `torch.storage.UntypedStorage`: numel counts bytes; the tensor gives the dtype.
    Untyped,
}

/// The allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    RebuildMetaTensorNoStorage,
    Storage(StorageType),
    Dtype(Elem),
    TensorClass,
    ParameterClass,
}

impl Global {
    fn name(self) -> String {
        match self {
            Global::OrderedDict => "collections.OrderedDict".into(),
            Global::RebuildTensorV2 => "torch._utils._rebuild_tensor_v2".into(),
            Global::RebuildTensorV3 => "torch._utils._rebuild_tensor_v3".into(),
            Global::RebuildParameter => "torch._utils._rebuild_parameter".into(),
            Global::RebuildParameterWithState => "torch._utils._rebuild_parameter_with_state".into(),
            Global::RebuildFromTypeV2 => "torch._tensor._rebuild_from_type_v2".into(),
            Global::RebuildMetaTensorNoStorage => "torch._utils._rebuild_meta_tensor_no_storage".into(),
            Global::Storage(StorageType::Untyped) => "torch.storage.UntypedStorage".into(),
            Global::Storage(StorageType::Typed(_, n)) => format!("torch.{n}"),
            Global::Dtype(Elem::Known(d)) => format!("the dtype {d}"),
            Global::Dtype(Elem::Unsupported(n)) => format!("torch.{n}"),
            Global::TensorClass => "torch.Tensor".into(),
            Global::ParameterClass => "torch.nn.parameter.Parameter".into(),
        }
    }
}

/// Typed storage classes torch writes (`torch.<name>`; CUDA ones as `torch.cuda.<name>`).
const TYPED_STORAGES: &[(&str, Elem)] = &[
    ("DoubleStorage", Elem::Known(Dtype::F64)),
    ("FloatStorage", Elem::Known(Dtype::F32)),
    ("HalfStorage", Elem::Known(Dtype::F16)),
    ("BFloat16Storage", Elem::Known(Dtype::BF16)),
    ("LongStorage", Elem::Known(Dtype::I64)),
    ("IntStorage", Elem::Known(Dtype::I32)),
    ("ShortStorage", Elem::Known(Dtype::I16)),
    ("CharStorage", Elem::Known(Dtype::I8)),
    ("ByteStorage", Elem::Known(Dtype::U8)),
    ("BoolStorage", Elem::Known(Dtype::BOOL)),
    ("ComplexFloatStorage", Elem::Known(Dtype::C64)),
    ("ComplexDoubleStorage", Elem::Unsupported("complex128")),
    ("QInt8Storage", Elem::Unsupported("qint8")),
    ("QUInt8Storage", Elem::Unsupported("quint8")),
    ("QInt32Storage", Elem::Unsupported("qint32")),
    ("QUInt4x2Storage", Elem::Unsupported("quint4x2")),
    ("QUInt2x4Storage", Elem::Unsupported("quint2x4")),
];

/// `torch.<dtype>` objects, as `_rebuild_tensor_v3` receives them (the dtypes without a typed
/// storage class: unsigned, float8, ...; but torch may write any).
const DTYPES: &[(&str, Elem)] = &[
    ("float64", Elem::Known(Dtype::F64)),
    ("float32", Elem::Known(Dtype::F32)),
    ("float16", Elem::Known(Dtype::F16)),
    ("bfloat16", Elem::Known(Dtype::BF16)),
    ("int64", Elem::Known(Dtype::I64)),
    ("int32", Elem::Known(Dtype::I32)),
    ("int16", Elem::Known(Dtype::I16)),
    ("int8", Elem::Known(Dtype::I8)),
    ("uint8", Elem::Known(Dtype::U8)),
    ("uint16", Elem::Known(Dtype::U16)),
    ("uint32", Elem::Known(Dtype::U32)),
    ("uint64", Elem::Known(Dtype::U64)),
    ("bool", Elem::Known(Dtype::BOOL)),
    ("complex64", Elem::Known(Dtype::C64)),
    ("float8_e4m3fn", Elem::Known(Dtype::F8_E4M3)),
    ("float8_e5m2", Elem::Known(Dtype::F8_E5M2)),
    ("float8_e4m3fnuz", Elem::Known(Dtype::F8_E4M3FNUZ)),
    ("float8_e5m2fnuz", Elem::Known(Dtype::F8_E5M2FNUZ)),
    ("float8_e8m0fnu", Elem::Known(Dtype::F8_E8M0)),
    ("complex128", Elem::Unsupported("complex128")),
    ("complex32", Elem::Unsupported("complex32")),
    ("float4_e2m1fn_x2", Elem::Unsupported("float4_e2m1fn_x2")),
    ("bits1x8", Elem::Unsupported("bits1x8")),
    ("bits2x4", Elem::Unsupported("bits2x4")),
    ("bits4x2", Elem::Unsupported("bits4x2")),
    ("bits8", Elem::Unsupported("bits8")),
    ("bits16", Elem::Unsupported("bits16")),
    ("qint8", Elem::Unsupported("qint8")),
    ("quint8", Elem::Unsupported("quint8")),
    ("qint32", Elem::Unsupported("qint32")),
    ("quint4x2", Elem::Unsupported("quint4x2")),
    ("quint2x4", Elem::Unsupported("quint2x4")),
];

fn resolve_global(module: &str, name: &str) -> Option<Global> {
    Some(match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildTensorV3,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
        ("torch._tensor", "_rebuild_from_type_v2") => Global::RebuildFromTypeV2,
        ("torch._utils", "_rebuild_meta_tensor_no_storage") => Global::RebuildMetaTensorNoStorage,
        ("torch.storage", "UntypedStorage") => Global::Storage(StorageType::Untyped),
        ("torch", "Tensor") => Global::TensorClass,
        ("torch.nn.parameter", "Parameter") => Global::ParameterClass,
        ("torch" | "torch.cuda", _) if name.ends_with("Storage") => {
            let (n, e) = TYPED_STORAGES.iter().find(|(n, _)| *n == name)?;
            Global::Storage(StorageType::Typed(*e, n))
        }
        ("torch", _) => Global::Dtype(DTYPES.iter().find(|(n, _)| *n == name)?.1),
        _ => return None,
    })
}

/// A storage as its persistent id describes it: `('storage', type, key, location, numel)`.
#[derive(Debug, Clone)]
pub(crate) struct StorageRef {
    pub ty: StorageType,
    pub key: String,
    pub location: String,
    pub numel: u64,
    /// False for the storage a meta tensor saved without one stands on (nothing in the archive).
    pub record: bool,
}

/// A tensor as its rebuild call describes it.
#[derive(Debug, Clone)]
pub(crate) struct TensorObj {
    pub storage: Id,
    pub elem: Elem,
    pub offset: u64,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub requires_grad: bool,
    pub parameter: bool,
    /// The conjugate bit of the metadata argument: the logical values are the conjugates.
    pub conj: bool,
    /// The negative bit: the logical values are the negatives of the stored ones.
    pub neg: bool,
}

#[derive(Debug)]
pub(crate) enum Obj {
    Str(String),
    /// Bytes describe no tensor; only their presence is kept.
    Bytes,
    Tuple(Vec<Val>),
    List(Vec<Val>),
    Dict(Vec<(Val, Val)>),
    Global(Global),
    // Boxed so the common objects (strings, tuples, lists, dicts) take 32 bytes each.
    Storage(Box<StorageRef>),
    Tensor(Box<TensorObj>),
}

impl Obj {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Obj::Str(_) => "str",
            Obj::Bytes => "bytes",
            Obj::Tuple(_) => "tuple",
            Obj::List(_) => "list",
            Obj::Dict(_) => "dict",
            Obj::Global(_) => "class or function",
            Obj::Storage(_) => "storage",
            Obj::Tensor(_) => "tensor",
        }
    }
}

/// The result of running a pickle: the root value and the arena it points into.
pub(crate) struct Unpickled {
    pub root: Val,
    pub objs: Vec<Obj>,
    /// Objects plus container items the pickle made.
    pub items: u64,
}

impl Unpickled {
    pub(crate) fn obj(&self, id: Id) -> &Obj {
        // Ids are only made by `Vm::alloc`, so they are in range.
        &self.objs[id as usize]
    }
}

/// Names of every pickle opcode, for error messages.
fn opname(op: u8) -> &'static str {
    match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "unknown opcode",
    }
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    /// Position of the opcode being run, for errors.
    at: usize,
    stack: Vec<Val>,
    marks: Vec<usize>,
    memo: HashMap<u32, Val>,
    objs: Vec<Obj>,
    /// Objects plus container elements made so far.
    items: u64,
    /// Bytes held by the arena, its containers and the memo (an estimate from the sizes of what
    /// was stored, not from the allocator), checked against `max_unpickled_bytes`.
    bytes: u64,
    /// The one empty tuple (`EMPTY_TUPLE` is common and tuples are immutable).
    empty_tuple: Option<Val>,
    limits: &'a Limits,
}

pub(crate) fn unpickle(data: &[u8], limits: &Limits) -> Result<Unpickled, PtError> {
    let mut vm = Vm {
        data,
        pos: 0,
        at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        objs: Vec::new(),
        items: 0,
        bytes: 0,
        empty_tuple: None,
        limits,
    };
    let root = vm.run()?;
    Ok(Unpickled { root, objs: vm.objs, items: vm.items })
}

impl<'a> Vm<'a> {
    fn err(&self, msg: impl Into<String>) -> PtError {
        PtError::Pickle { pos: self.at as u64, msg: msg.into() }
    }

    fn forbid(&self, what: impl Into<String>) -> PtError {
        PtError::Forbidden { pos: self.at as u64, what: what.into() }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PtError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        match end {
            Some(end) => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!(
                "{} wants {n} bytes but the pickle ends {} bytes later (truncated or a bogus length)",
                opname(self.data[self.at]),
                self.data.len() - self.pos
            ))),
        }
    }

    fn u8(&mut self) -> Result<u8, PtError> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], PtError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len_u64(&mut self, n: u64) -> Result<usize, PtError> {
        usize::try_from(n).map_err(|_| self.err(format!("length {n} is too large")))
    }

    fn count(&mut self, n: u64) -> Result<(), PtError> {
        self.items = self.items.saturating_add(n);
        if self.items > self.limits.max_items as u64 {
            return Err(PtError::Limit {
                what: format!("the pickle's objects and container items (at byte {})", self.at),
                limit: self.limits.max_items as u64,
                field: "max_items",
            });
        }
        Ok(())
    }

    /// Charges `n` bytes of memory the VM keeps to [`Limits::max_unpickled_bytes`].
    fn charge(&mut self, n: usize) -> Result<(), PtError> {
        self.bytes = self.bytes.saturating_add(n as u64);
        if self.bytes > self.limits.max_unpickled_bytes {
            return Err(PtError::Limit {
                what: format!("memory held by the pickle's objects (at byte {})", self.at),
                limit: self.limits.max_unpickled_bytes,
                field: "max_unpickled_bytes",
            });
        }
        Ok(())
    }

    fn alloc(&mut self, o: Obj) -> Result<Val, PtError> {
        self.count(1)?;
        let heap = match &o {
            Obj::Str(s) => s.len(),
            Obj::Bytes | Obj::Global(_) => 0,
            Obj::Tuple(v) | Obj::List(v) => v.len() * std::mem::size_of::<Val>(),
            Obj::Dict(v) => v.len() * std::mem::size_of::<(Val, Val)>(),
            Obj::Storage(s) => std::mem::size_of::<StorageRef>() + s.key.len() + s.location.len(),
            Obj::Tensor(t) => {
                std::mem::size_of::<TensorObj>() + (t.shape.len() + t.strides.len()) * std::mem::size_of::<usize>()
            }
        };
        self.charge(std::mem::size_of::<Obj>() + heap)?;
        let id = Id::try_from(self.objs.len()).map_err(|_| self.err("too many objects"))?;
        // The arena is the VM's one large allocation: growing it fails as an error.
        self.objs.try_reserve(1).map_err(|_| self.err(format!("out of memory for {} objects", self.objs.len() + 1)))?;
        self.objs.push(o);
        Ok(Val::Obj(id))
    }

    fn push(&mut self, v: Val) -> Result<(), PtError> {
        if self.stack.len() >= self.limits.max_stack {
            return Err(PtError::Limit {
                what: format!("the pickle's stack (at byte {})", self.at),
                limit: self.limits.max_stack as u64,
                field: "max_stack",
            });
        }
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self) -> Result<Val, PtError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err(format!("{} on an empty stack", opname(self.data[self.at]))));
        }
        self.stack.pop().ok_or_else(|| self.err("stack underflow"))
    }

    fn top(&self) -> Result<Val, PtError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err(format!("{} on an empty stack", opname(self.data[self.at]))));
        }
        self.stack.last().copied().ok_or_else(|| self.err("stack underflow"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Val>, PtError> {
        let Some(m) = self.marks.pop() else {
            return Err(self.err(format!("{} without a MARK", opname(self.data[self.at]))));
        };
        Ok(self.stack.split_off(m))
    }

    fn obj(&self, v: Val) -> Option<&Obj> {
        match v {
            Val::Obj(id) => self.objs.get(id as usize),
            _ => None,
        }
    }

    fn describe(&self, v: Val) -> &'static str {
        match v {
            Val::None => "None",
            Val::Bool(_) => "bool",
            Val::Int(_) => "int",
            Val::Float => "float",
            Val::Obj(_) => self.obj(v).map_or("?", Obj::kind),
        }
    }

    fn string(&mut self, bytes: &[u8]) -> Result<Val, PtError> {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                let owned = self.owned_str(s)?;
                self.alloc(Obj::Str(owned))
            }
            Err(_) => Err(self.err("string is not valid UTF-8")),
        }
    }

    /// A copy of `s`, its allocation failing as an error rather than aborting the process.
    fn owned_str(&self, s: &str) -> Result<String, PtError> {
        let mut owned = String::new();
        owned
            .try_reserve_exact(s.len())
            .map_err(|_| self.err(format!("out of memory for a string of {} bytes", s.len())))?;
        owned.push_str(s);
        Ok(owned)
    }

    fn str_of(&self, v: Val) -> Option<&str> {
        match self.obj(v) {
            Some(Obj::Str(s)) => Some(s),
            _ => None,
        }
    }

    fn memo_put(&mut self, key: u32) -> Result<(), PtError> {
        let v = self.top()?;
        if !self.memo.contains_key(&key) {
            if self.memo.len() >= self.limits.max_memo {
                return Err(PtError::Limit {
                    what: format!("the pickle's memo (at byte {})", self.at),
                    limit: self.limits.max_memo as u64,
                    field: "max_memo",
                });
            }
            // A hash table entry: key, value and control bytes, with the table's slack.
            self.charge(2 * (std::mem::size_of::<(u32, Val)>() + 1))?;
        }
        self.memo.insert(key, v);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), PtError> {
        match self.memo.get(&key).copied() {
            Some(v) => self.push(v),
            None => Err(self.err(format!("memo entry {key} read before it was written"))),
        }
    }

    fn global(&mut self, module: &str, name: &str) -> Result<(), PtError> {
        match resolve_global(module, name) {
            Some(g) => {
                let v = self.alloc(Obj::Global(g))?;
                self.push(v)
            }
            None => Err(self.forbid(format!("global {module}.{name}"))),
        }
    }

    fn int(&mut self, bytes: &[u8]) -> Result<Val, PtError> {
        if bytes.len() > 8 {
            return Err(self.err(format!("integer of {} bytes does not fit in 64 bits", bytes.len())));
        }
        if bytes.is_empty() {
            return Ok(Val::Int(0));
        }
        let fill = if bytes[bytes.len() - 1] & 0x80 != 0 { 0xFF } else { 0 };
        let mut a = [fill; 8];
        a[..bytes.len()].copy_from_slice(bytes);
        Ok(Val::Int(i64::from_le_bytes(a)))
    }

    fn run(&mut self) -> Result<Val, PtError> {
        loop {
            self.at = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(self.err("the pickle ends without STOP"));
            };
            self.pos += 1;
            match op {
                0x80 => {
                    let v = self.u8()?;
                    if v > 5 {
                        return Err(self.err(format!("pickle protocol {v} (at most 5 exists)")));
                    }
                }
                0x95 => {
                    self.le::<8>()?; // FRAME: a size hint; the whole pickle is in memory anyway
                }
                b'.' => {
                    let v = self.pop()?;
                    return Ok(v);
                }
                b'(' => {
                    if self.marks.len() >= self.limits.max_depth {
                        return Err(PtError::Limit {
                            what: format!("nesting of the pickle (MARK at byte {})", self.at),
                            limit: self.limits.max_depth as u64,
                            field: "max_depth",
                        });
                    }
                    self.marks.push(self.stack.len());
                }
                b'N' => self.push(Val::None)?,
                0x88 => self.push(Val::Bool(true))?,
                0x89 => self.push(Val::Bool(false))?,
                b'J' => {
                    let v = i32::from_le_bytes(self.le()?);
                    self.push(Val::Int(v.into()))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Val::Int(v.into()))?
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le()?);
                    self.push(Val::Int(v.into()))?
                }
                0x8a => {
                    let n = self.u8()?;
                    let b = self.take(n.into())?;
                    let v = self.int(b)?;
                    self.push(v)?
                }
                b'G' => {
                    self.le::<8>()?;
                    self.push(Val::Float)?
                }
                b'X' | 0x8c | 0x8d | b'B' | b'C' | 0x8e | b'U' => {
                    let n = match op {
                        0x8c | b'C' | b'U' => u64::from(self.u8()?),
                        b'X' | b'B' => u32::from_le_bytes(self.le()?).into(),
                        _ => u64::from_le_bytes(self.le()?),
                    };
                    let n = self.len_u64(n)?;
                    let b = self.take(n)?;
                    let v = match op {
                        b'B' | b'C' | 0x8e => self.alloc(Obj::Bytes)?,
                        // SHORT_BINSTRING: text if it decodes, else bytes.
                        b'U' => match std::str::from_utf8(b) {
                            Ok(s) => {
                                let owned = self.owned_str(s)?;
                                self.alloc(Obj::Str(owned))?
                            }
                            Err(_) => self.alloc(Obj::Bytes)?,
                        },
                        _ => self.string(b)?,
                    };
                    self.push(v)?
                }
                b')' => {
                    let v = match self.empty_tuple {
                        Some(v) => v,
                        None => {
                            let v = self.alloc(Obj::Tuple(Vec::new()))?;
                            self.empty_tuple = Some(v);
                            v
                        }
                    };
                    self.push(v)?
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.count(n as u64)?;
                    let v = self.alloc(Obj::Tuple(items))?;
                    self.push(v)?
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.count(items.len() as u64)?;
                    let v = self.alloc(Obj::Tuple(items))?;
                    self.push(v)?
                }
                b']' => {
                    let v = self.alloc(Obj::List(Vec::new()))?;
                    self.push(v)?
                }
                b'}' => {
                    let v = self.alloc(Obj::Dict(Vec::new()))?;
                    self.push(v)?
                }
                b'a' => {
                    let item = self.pop()?;
                    self.extend_list(vec![item])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.extend_dict(vec![(k, v)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    self.extend_dict(pairs)?;
                }
                b'h' => {
                    let k = self.u8()?;
                    self.memo_get(k.into())?
                }
                b'j' => {
                    let k = u32::from_le_bytes(self.le()?);
                    self.memo_get(k)?
                }
                b'q' => {
                    let k = self.u8()?;
                    self.memo_put(k.into())?
                }
                b'r' => {
                    let k = u32::from_le_bytes(self.le()?);
                    self.memo_put(k)?
                }
                0x94 => {
                    let k = u32::try_from(self.memo.len()).map_err(|_| self.err("memo too large"))?;
                    self.memo_put(k)?
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(&module, &name)?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Some(m), Some(n)) = (self.str_of(module), self.str_of(name)) else {
                        return Err(self.err("STACK_GLOBAL needs two strings"));
                    };
                    let (m, n) = (m.to_owned(), n.to_owned());
                    self.global(&m, &n)?
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent(pid)?;
                    self.push(v)?
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let v = self.reduce(func, args)?;
                    self.push(v)?
                }
                b'b' => {
                    let state = self.pop()?;
                    let target = self.top()?;
                    self.build(target, state)?
                }
                _ => return Err(self.forbid(format!("opcode {} ({op:#04x})", opname(op)))),
            }
        }
    }

    /// A newline-terminated operand of GLOBAL (printable ASCII, as Python writes it).
    fn line(&mut self) -> Result<String, PtError> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().take(1024).position(|&b| b == b'\n') else {
            return Err(self.err("GLOBAL operand without a newline within 1024 bytes"));
        };
        let s = &rest[..n];
        self.pos += n + 1;
        if !s.iter().all(|b| b.is_ascii_graphic()) {
            return Err(self.err("GLOBAL operand is not printable ASCII"));
        }
        Ok(String::from_utf8_lossy(s).into_owned())
    }

    fn pairs(&mut self, items: Vec<Val>) -> Result<Vec<(Val, Val)>, PtError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.err(format!("{} with an odd number of items", opname(self.data[self.at]))));
        }
        self.count(items.len() as u64)?;
        let mut it = items.into_iter();
        let mut out = Vec::with_capacity(it.len() / 2);
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            out.push((k, v));
        }
        Ok(out)
    }

    fn extend_list(&mut self, items: Vec<Val>) -> Result<(), PtError> {
        let target = self.top()?;
        self.count(items.len() as u64)?;
        self.charge(items.len() * std::mem::size_of::<Val>())?;
        let what = self.describe(target);
        match target {
            Val::Obj(id) => match self.objs.get_mut(id as usize) {
                Some(Obj::List(l)) => {
                    l.extend(items);
                    Ok(())
                }
                _ => Err(self.forbid(format!("{} to a {what}", opname(self.data[self.at])))),
            },
            _ => Err(self.forbid(format!("{} to a {what}", opname(self.data[self.at])))),
        }
    }

    fn extend_dict(&mut self, pairs: Vec<(Val, Val)>) -> Result<(), PtError> {
        let target = self.top()?;
        self.count(pairs.len() as u64)?;
        self.charge(pairs.len() * std::mem::size_of::<(Val, Val)>())?;
        let what = self.describe(target);
        match target {
            Val::Obj(id) => match self.objs.get_mut(id as usize) {
                Some(Obj::Dict(d)) => {
                    d.extend(pairs);
                    Ok(())
                }
                _ => Err(self.forbid(format!("{} on a {what}", opname(self.data[self.at])))),
            },
            _ => Err(self.forbid(format!("{} on a {what}", opname(self.data[self.at])))),
        }
    }

    fn build(&mut self, target: Val, state: Val) -> Result<(), PtError> {
        // OrderedDict.__reduce__ gives its __dict__ (nn.Module state dicts: `_metadata`) as BUILD
        // state. It describes no tensor; accept it on a dict and drop it.
        let target_is_dict = matches!(self.obj(target), Some(Obj::Dict(_)));
        let state_ok = matches!(state, Val::None) || matches!(self.obj(state), Some(Obj::Dict(_)));
        if target_is_dict && state_ok {
            return Ok(());
        }
        Err(self.forbid(format!("BUILD of a {} with a {} state", self.describe(target), self.describe(state))))
    }

    fn persistent(&mut self, pid: Val) -> Result<Val, PtError> {
        let parts = match self.obj(pid) {
            Some(Obj::Tuple(t)) => t.clone(),
            _ => {
                return Err(
                    self.forbid(format!("persistent id of a {} (torch writes storage tuples)", self.describe(pid)))
                )
            }
        };
        let [tag, ty, key, location, numel] = parts.as_slice() else {
            return Err(self.err(format!("persistent id tuple of {} items (torch writes 5)", parts.len())));
        };
        if self.str_of(*tag) != Some("storage") {
            return Err(self.forbid("persistent id whose tag is not 'storage'"));
        }
        let ty = match self.obj(*ty) {
            Some(Obj::Global(Global::Storage(t))) => *t,
            _ => return Err(self.err(format!("persistent id: storage type is a {}", self.describe(*ty)))),
        };
        let (Some(key), Some(location)) = (self.str_of(*key), self.str_of(*location)) else {
            return Err(self.err("persistent id: key and location must be strings"));
        };
        let numel = match *numel {
            Val::Int(n) if n >= 0 => n as u64,
            other => return Err(self.err(format!("persistent id: numel is a {}", self.describe(other)))),
        };
        let s = StorageRef { ty, key: key.to_owned(), location: location.to_owned(), numel, record: true };
        self.alloc(Obj::Storage(Box::new(s)))
    }

    fn ints(&self, v: Val, what: &str) -> Result<Vec<usize>, PtError> {
        let Some(Obj::Tuple(items)) = self.obj(v) else {
            return Err(self.err(format!("tensor {what} is a {}, not a tuple", self.describe(v))));
        };
        items
            .iter()
            .map(|i| match *i {
                Val::Int(n) if n >= 0 => {
                    usize::try_from(n).map_err(|_| self.err(format!("tensor {what} {n} too large")))
                }
                other => {
                    Err(self
                        .err(format!("tensor {what} holds a {} (non-negative ints expected)", self.describe(other))))
                }
            })
            .collect()
    }

    fn tensor(&self, v: Val) -> Option<&TensorObj> {
        match self.obj(v) {
            Some(Obj::Tensor(t)) => Some(t),
            _ => None,
        }
    }

    /// The metadata argument of `_rebuild_tensor_v2/v3`, as torch applies it
    /// (`torch._utils.set_tensor_metadata`): nothing when it is falsy (`None`, `False`, `0`, an
    /// empty container or string); otherwise it must be a dict of string keys and bool or int
    /// values, and a `conj` or `neg` key sets that bit whatever its value (torch's
    /// `_set_tensor_metadata` does), other keys are ignored. The conjugate bit needs a complex
    /// dtype, the negative bit a numeric one whose negation turboio can compute.
    fn tensor_metadata(&self, g: Global, m: Val, elem: Elem) -> Result<(bool, bool), PtError> {
        let falsy = match m {
            Val::None | Val::Bool(false) | Val::Int(0) => true,
            Val::Obj(_) => match self.obj(m) {
                Some(Obj::Str(s)) => s.is_empty(),
                Some(Obj::Tuple(v) | Obj::List(v)) => v.is_empty(),
                Some(Obj::Dict(v)) => v.is_empty(),
                _ => false,
            },
            _ => false,
        };
        if falsy {
            return Ok((false, false));
        }
        let Some(Obj::Dict(pairs)) = self.obj(m) else {
            return Err(self.err(format!(
                "{}: the metadata argument is a {} (torch requires a dict)",
                g.name(),
                self.describe(m)
            )));
        };
        let (mut conj, mut neg) = (false, false);
        for (k, v) in pairs {
            let Some(key) = self.str_of(*k) else {
                return Err(self.err(format!(
                    "{}: a metadata key is a {} (str expected)",
                    g.name(),
                    self.describe(*k)
                )));
            };
            if !matches!(v, Val::Bool(_) | Val::Int(_)) {
                return Err(self.err(format!(
                    "{}: metadata `{key}` is a {} (bool expected)",
                    g.name(),
                    self.describe(*v)
                )));
            }
            match key {
                "conj" => conj = true,
                "neg" => neg = true,
                _ => {}
            }
        }
        let dtype = match elem {
            Elem::Known(d) => d,
            Elem::Unsupported(_) => return Ok((conj, neg)),
        };
        if conj && dtype != Dtype::C64 {
            return Err(self.err(format!(
                "{}: the conjugate bit on a {dtype} tensor (torch allows it on complex ones only)",
                g.name()
            )));
        }
        if neg && !crate::bits::negatable(dtype) {
            return Err(self.err(format!(
                "{}: the negative bit on a {dtype} tensor, whose negation turboio does not compute",
                g.name()
            )));
        }
        Ok((conj, neg))
    }

    /// A rebuild function's `requires_grad` argument (a bool).
    fn requires_grad(&self, g: Global, v: Val) -> Result<bool, PtError> {
        match v {
            Val::Bool(b) => Ok(b),
            other => Err(self.err(format!("{}: requires_grad is a {}", g.name(), self.describe(other)))),
        }
    }

    fn reduce(&mut self, func: Val, args: Val) -> Result<Val, PtError> {
        let g = match self.obj(func) {
            Some(Obj::Global(g)) => *g,
            _ => return Err(self.forbid(format!("REDUCE of a {}", self.describe(func)))),
        };
        let args = match self.obj(args) {
            Some(Obj::Tuple(a)) => a.clone(),
            _ => {
                return Err(self.err(format!(
                    "REDUCE of {} with {} arguments (a tuple expected)",
                    g.name(),
                    self.describe(args)
                )))
            }
        };
        self.apply(g, &args)
    }

    fn apply(&mut self, g: Global, args: &[Val]) -> Result<Val, PtError> {
        match g {
            Global::OrderedDict => {
                if !args.is_empty() {
                    return Err(self.forbid("collections.OrderedDict called with arguments"));
                }
                self.alloc(Obj::Dict(Vec::new()))
            }
            Global::RebuildTensorV2 | Global::RebuildTensorV3 => {
                let v3 = g == Global::RebuildTensorV3;
                let (min, max) = if v3 { (7, 8) } else { (6, 7) };
                if args.len() < min || args.len() > max {
                    return Err(self.err(format!(
                        "{} with {} arguments ({min} or {max} expected)",
                        g.name(),
                        args.len()
                    )));
                }
                let storage = match args[0] {
                    Val::Obj(id) if matches!(self.objs.get(id as usize), Some(Obj::Storage(_))) => id,
                    other => return Err(self.err(format!("{}: storage is a {}", g.name(), self.describe(other)))),
                };
                let offset = match args[1] {
                    Val::Int(n) if n >= 0 => n as u64,
                    other => {
                        return Err(self.err(format!("{}: storage offset is a {}", g.name(), describe_int(other))))
                    }
                };
                let shape = self.ints(args[2], "size")?;
                let strides = self.ints(args[3], "stride")?;
                if shape.len() != strides.len() {
                    return Err(self.err(format!(
                        "{}: size has {} dimensions but stride has {}",
                        g.name(),
                        shape.len(),
                        strides.len()
                    )));
                }
                if shape.len() > 64 {
                    return Err(self.err(format!("{}: {} dimensions (at most 64)", g.name(), shape.len())));
                }
                let requires_grad = self.requires_grad(g, args[4])?;
                let elem = if v3 {
                    match self.obj(args[6]) {
                        Some(Obj::Global(Global::Dtype(e))) => *e,
                        _ => return Err(self.err(format!("{}: dtype is a {}", g.name(), self.describe(args[6])))),
                    }
                } else {
                    let ty = match &self.objs[storage as usize] {
                        Obj::Storage(s) => Some(s.ty),
                        _ => None,
                    };
                    match ty {
                        Some(StorageType::Typed(e, _)) => e,
                        _ => {
                            return Err(
                                self.err(format!("{}: an untyped storage needs _rebuild_tensor_v3's dtype", g.name()))
                            )
                        }
                    }
                };
                let metadata = if v3 { args.get(7) } else { args.get(6) };
                let (conj, neg) = match metadata {
                    Some(&m) => self.tensor_metadata(g, m, elem)?,
                    None => (false, false),
                };
                let t = TensorObj { storage, elem, offset, shape, strides, requires_grad, parameter: false, conj, neg };
                self.count(t.shape.len() as u64 * 2)?;
                self.alloc(Obj::Tensor(Box::new(t)))
            }
            Global::RebuildMetaTensorNoStorage => {
                // (dtype, size, stride, requires_grad): torch.empty_strided(..., device="meta").
                if args.len() != 4 {
                    return Err(self.err(format!("{} with {} arguments (4 expected)", g.name(), args.len())));
                }
                let elem = match self.obj(args[0]) {
                    Some(Obj::Global(Global::Dtype(e))) => *e,
                    _ => return Err(self.err(format!("{}: dtype is a {}", g.name(), self.describe(args[0])))),
                };
                let shape = self.ints(args[1], "size")?;
                let strides = self.ints(args[2], "stride")?;
                if shape.len() != strides.len() || shape.len() > 64 {
                    return Err(self.err(format!(
                        "{}: size has {} dimensions and stride {} (equal, at most 64)",
                        g.name(),
                        shape.len(),
                        strides.len()
                    )));
                }
                let requires_grad = self.requires_grad(g, args[3])?;
                // The elements the strided view reaches: what its (absent) storage would hold.
                let mut extent: u64 = 1;
                for (&d, &st) in shape.iter().zip(&strides) {
                    if d == 0 {
                        extent = 0;
                        break;
                    }
                    let reach =
                        (d as u64 - 1).checked_mul(st as u64).ok_or_else(|| self.err("meta tensor too large"))?;
                    extent = extent.checked_add(reach).ok_or_else(|| self.err("meta tensor too large"))?;
                }
                let ty = StorageType::Typed(elem, "meta");
                let s = StorageRef { ty, key: String::new(), location: "meta".into(), numel: extent, record: false };
                let storage = match self.alloc(Obj::Storage(Box::new(s)))? {
                    Val::Obj(id) => id,
                    _ => return Err(self.err("meta storage")),
                };
                let t = TensorObj {
                    storage,
                    elem,
                    offset: 0,
                    shape,
                    strides,
                    requires_grad,
                    parameter: false,
                    conj: false,
                    neg: false,
                };
                self.count(t.shape.len() as u64 * 2)?;
                self.alloc(Obj::Tensor(Box::new(t)))
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => {
                let n = if g == Global::RebuildParameter { 3 } else { 4 };
                if args.len() != n {
                    return Err(self.err(format!("{} with {} arguments ({n} expected)", g.name(), args.len())));
                }
                let Some(t) = self.tensor(args[0]) else {
                    return Err(self.err(format!("{}: data is a {}", g.name(), self.describe(args[0]))));
                };
                let mut t = t.clone();
                t.requires_grad = self.requires_grad(g, args[1])?;
                t.parameter = true;
                self.count(t.shape.len() as u64 * 2)?;
                self.alloc(Obj::Tensor(Box::new(t)))
            }
            Global::RebuildFromTypeV2 => {
                // (func, new_type, args, state): a tensor subclass or a tensor with attributes.
                if args.len() != 4 {
                    return Err(self.err(format!("{} with {} arguments (4 expected)", g.name(), args.len())));
                }
                let func = match self.obj(args[0]) {
                    Some(Obj::Global(
                        f @ (Global::RebuildTensorV2
                        | Global::RebuildTensorV3
                        | Global::RebuildParameter
                        | Global::RebuildParameterWithState),
                    )) => *f,
                    _ => {
                        return Err(self.forbid(format!("{} with a {} as function", g.name(), self.describe(args[0]))))
                    }
                };
                let parameter = match self.obj(args[1]) {
                    Some(Obj::Global(Global::TensorClass)) => false,
                    Some(Obj::Global(Global::ParameterClass)) => true,
                    Some(Obj::Global(other)) => {
                        return Err(self.forbid(format!("{} to type {}", g.name(), other.name())));
                    }
                    _ => return Err(self.forbid(format!("{} to a {}", g.name(), self.describe(args[1])))),
                };
                let inner = match self.obj(args[2]) {
                    Some(Obj::Tuple(a)) => a.clone(),
                    _ => return Err(self.err(format!("{}: args is a {}", g.name(), self.describe(args[2])))),
                };
                let v = self.apply(func, &inner)?;
                if parameter {
                    if let Val::Obj(id) = v {
                        if let Some(Obj::Tensor(t)) = self.objs.get_mut(id as usize) {
                            t.parameter = true;
                        }
                    }
                }
                Ok(v)
            }
            Global::Storage(_) | Global::Dtype(_) | Global::TensorClass | Global::ParameterClass => {
                Err(self.forbid(format!("calling {}", g.name())))
            }
        }
    }
}

fn describe_int(v: Val) -> &'static str {
    match v {
        Val::Int(_) => "negative int",
        Val::None => "None",
        Val::Bool(_) => "bool",
        Val::Float => "float",
        Val::Obj(_) => "object",
    }
}
