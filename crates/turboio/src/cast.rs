//! Dtype conversion on load ([`LoadOptions::dtype`]).
//!
//! A converting load brings the file in the way a plain load would (mapped from the page cache
//! for local files, copied for encrypted or remote ones) and converts each floating tensor into
//! one new CPU arena laid out as the safetensors file of the converted tensors would be (the
//! result is an ordinary [`LoadedFile`] whose header says the new dtypes). Tensors that are not
//! floating, or already have the dtype, are copied as they are.
//!
//! The conversion is fused with the read: for a cold mapped file the whole range is asked for
//! first (`MADV_WILLNEED`) and the converting threads read the mapping in file order, so they
//! convert each piece as the disk delivers it instead of waiting for the whole file. Hot, the
//! mapping is populated from the page cache (no copy) and the conversion is the only pass over
//! the bytes. Either way the bytes move once: page cache -> converted arena, the same traffic as
//! a plain copied load, plus the arithmetic ([`turboio_format::cast()`], bit-identical to torch's
//! `.to()`).
//!
//! Onto a device that converts in its own memory ([`Device::casts`]: the CUDA device, with an
//! NVRTC-compiled kernel whose source is checked bit for bit against the host conversion), the
//! file is loaded as it is (staged, from the page cache, or by GPUDirect Storage) and the kernel
//! converts it into a new device allocation; the host does no conversion work. Where the kernel
//! cannot run, and onto devices without one, the conversion runs on the host and the converted
//! arena is uploaded (a line in [`LoadReport::fallbacks`](crate::LoadReport::fallbacks) says
//! why).

use crate::loaded::{Held, LoadedFile};
use crate::options::LoadOptions;
use crate::{Error, Result};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use turboio_device::{CastJob, CpuDevice, Device};
use turboio_format::{can_cast, castable, Dtype, Header, TensorInfo, TensorSpec};

/// Source bytes per conversion piece: small enough to spread a tensor over every thread and
/// to follow a cold read closely, large enough that handing pieces out costs nothing.
const PIECE: usize = 4 << 20;

/// Whether a load converting to `target` converts this tensor.
fn converts(t: &TensorInfo, target: Dtype) -> bool {
    t.dtype != target && castable(t.dtype) && castable(target)
}

/// Whether a load converting to `target` converts any of `header`'s tensors.
pub(crate) fn converts_any(header: &Header, target: Dtype) -> bool {
    header.tensors().iter().any(|t| converts(t, target))
}

/// Refuses, before any I/O, a dtype nothing can be converted to.
pub(crate) fn check_target(path: &Path, target: Dtype) -> Result<()> {
    if castable(target) {
        return Ok(());
    }
    Err(Error::Unsupported {
        path: path.to_owned(),
        message: format!(
            "cannot convert tensors to {target} on load: the target must be a floating dtype \
             (F64, F32, F16, BF16, F8_E4M3 or F8_E5M2)"
        ),
    })
}

/// Bytes of the arena a load converting `header`'s tensors (those `selection` keeps) to
/// `target` fills: converted tensors at their new size, the others as they are.
pub(crate) fn converted_bytes(header: &Header, target: Dtype, selection: Option<&crate::Selection>) -> u64 {
    let kept: Vec<usize> = selection.map_or_else(|| (0..header.len()).collect(), |s| s.positions(header));
    kept.iter()
        .map(|&i| {
            let t = &header.tensors()[i];
            if converts(t, target) {
                turboio_format::cast_len(t.len(), t.dtype, target).unwrap_or(usize::MAX) as u64
            } else {
                t.len() as u64
            }
        })
        .fold(0u64, u64::saturating_add)
}

/// The header of the converted tensors (laid out as the safetensors writer would) and its data
/// length.
fn converted_header(path: &Path, header: &Header, target: Dtype) -> Result<(Header, usize)> {
    let new_len = |t: &TensorInfo| {
        if converts(t, target) {
            turboio_format::cast_len(t.len(), t.dtype, target).unwrap_or(usize::MAX)
        } else {
            t.len()
        }
    };
    let specs = header
        .tensors()
        .iter()
        .map(|t| TensorSpec {
            name: &t.name,
            dtype: if converts(t, target) { target } else { t.dtype },
            shape: &t.shape,
            data_len: new_len(t),
        })
        .collect::<Vec<_>>();
    let layout = turboio_format::plan(&specs, header.metadata()).map_err(|e| Error::format(path, e))?;
    let converted = Header::parse(&layout.header, layout.file_len()).map_err(|e| Error::format(path, e))?;
    let data_len = usize::try_from(layout.data_len).map_err(|_| Error::Unsupported {
        path: path.to_owned(),
        message: "converted tensors too large for this address space".into(),
    })?;
    Ok((converted, data_len))
}

/// A load held in device memory, converted by the device's own kernel into a new allocation
/// of that device ([`cast_on_device`]); given back as it is when none of its tensors converts.
/// On an error `src` is freed too (a host conversion may then want the device's memory).
pub(crate) fn convert_on_device(src: LoadedFile, target: Dtype, device: &Arc<dyn Device>) -> Result<LoadedFile> {
    if !converts_any(&src.header, target) {
        return Ok(src);
    }
    cast_on_device(&src, target, device)
}

/// The report's line for a conversion the device could not run (`why`), run on the host.
pub(crate) fn ran_on_the_host(why: &Error) -> String {
    format!("dtype conversion ran on the host: the device could not: {why}")
}

/// Converts a load held in device memory with the device's own kernel ([`Device::cast`]) into
/// a new allocation of that device.
fn cast_on_device(src: &LoadedFile, target: Dtype, device: &Arc<dyn Device>) -> Result<LoadedFile> {
    let path = &src.path;
    let (header, data_len) = converted_header(path, &src.header, target)?;
    let memory = device.alloc(data_len.max(1)).map_err(|e| Error::device(path, e))?;
    let mut jobs = Vec::with_capacity(header.len());
    for d in header.tensors() {
        let Some(s) = src.header.get(&d.name) else { continue };
        let (from, to, elements) = if converts(s, target) {
            (s.dtype, target, s.len() / s.dtype.byte_size().unwrap_or(1))
        } else {
            (Dtype::U8, Dtype::U8, s.len()) // passed through: a byte copy
        };
        jobs.push(CastJob {
            src_offset: src.data_base + s.data_offsets.0,
            from,
            dst_offset: d.data_offsets.0,
            to,
            elements,
        });
    }
    device.cast(src.memory.as_ref(), memory.as_ref(), &jobs).map_err(|e| Error::device(path, e))?;
    let mut report = src.report.clone();
    report.converted = src.header.tensors().iter().filter(|t| converts(t, target)).count();
    Ok(LoadedFile { path: path.clone(), header, memory, data_base: 0, device: Some(device.clone()), report })
}

/// One piece of work: convert (or copy) `src` into `dst`.
struct Piece<'a> {
    src: &'a [u8],
    dst: &'a mut [u8],
    from: Dtype,
    to: Dtype,
    tensor: &'a str,
}

/// Converts the floating tensors of a loaded file (host memory) to `target`, into a new CPU
/// arena; a file with nothing to convert is given back as it is. `count_progress`: the source
/// was not populated yet, so the bytes it reads count as read here. Placing the result on a
/// device is the caller's next stage ([`crate::to_device::place`]).
pub(crate) fn cast_loaded(
    src: LoadedFile,
    target: Dtype,
    opts: &LoadOptions,
    cpu: &CpuDevice,
    count_progress: bool,
) -> Result<LoadedFile> {
    let path = src.path.clone();
    check_target(&path, target)?;
    let converted = src.header.tensors().iter().filter(|t| converts(t, target)).count();
    if converted == 0 {
        return Ok(src);
    }
    let Some(src_bytes) = src.memory.host() else {
        return Err(Error::Unsupported { path, message: "dtype conversion needs the bytes in host memory".into() });
    };
    let (header, data_len) = converted_header(&path, &src.header, target)?;
    let threads = turboio_storage::threads_or_default(opts.threads);
    let mut memory = cpu.alloc(data_len.max(1)).map_err(|e| Error::device(&path, e))?;
    let dst_all = memory
        .host_mut()
        .ok_or_else(|| Error::Unsupported { path: path.clone(), message: "the CPU arena has no host memory".into() })?;

    // Pieces in destination order (the layout tiles the data section), each at most PIECE
    // source bytes and a whole number of elements.
    let mut entries: Vec<(&TensorInfo, &TensorInfo)> =
        header.tensors().iter().filter_map(|d| Some((src.header.get(&d.name)?, d))).collect();
    entries.sort_by_key(|(_, d)| d.data_offsets.0);
    let mut pieces = Vec::new();
    let mut rest: &mut [u8] = &mut dst_all[..data_len];
    let mut at = 0usize;
    for (s, d) in entries {
        // The layout tiles the data section, so `skip` is empty; it is here for safety.
        let (_skip, tail) = std::mem::take(&mut rest).split_at_mut(d.data_offsets.0 - at);
        let (mut dst, tail) = tail.split_at_mut(d.len());
        rest = tail;
        at = d.data_offsets.1;
        let start = src.data_base + s.data_offsets.0;
        let mut source = &src_bytes[start..start + s.len()];
        let (from, to) = (s.dtype, d.dtype);
        let (fs, ts) = match (from.byte_size(), to.byte_size()) {
            (Some(f), Some(t)) if from != to => (f, t),
            // Copies (and sub-byte dtypes, which never convert) move in plain byte pieces.
            _ => (1, 1),
        };
        let per = (PIECE / fs).max(1);
        while !source.is_empty() {
            let n = per.min(source.len() / fs);
            let (a, b) = source.split_at(n * fs);
            let (c, e) = std::mem::take(&mut dst).split_at_mut(n * ts);
            pieces.push(Piece { src: a, dst: c, from, to, tensor: &s.name });
            source = b;
            dst = e;
        }
    }

    let queue = Mutex::new(pieces.into_iter());
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                if failed.lock().map(|f| f.is_some()).unwrap_or(true)
                    || opts.cancel.as_deref().is_some_and(|c| c.load(Ordering::Relaxed))
                {
                    return;
                }
                let Some(piece) = queue.lock().ok().and_then(|mut q| q.next()) else {
                    return;
                };
                let result = if piece.from == piece.to || !can_cast(piece.from, piece.to) {
                    piece.dst.copy_from_slice(piece.src);
                    Ok(())
                } else {
                    turboio_format::cast(piece.src, piece.from, piece.to, piece.dst)
                };
                if count_progress {
                    if let Some(p) = &opts.progress {
                        p.fetch_add(piece.src.len() as u64, Ordering::Relaxed);
                    }
                }
                if let Err(e) = result {
                    let message = format!("tensor `{}`: {e}", piece.tensor);
                    if let Ok(mut f) = failed.lock() {
                        f.get_or_insert(Error::Unsupported { path: path.clone(), message });
                    }
                    return;
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().ok().flatten() {
        return Err(e);
    }
    if opts.cancel.as_deref().is_some_and(|c| c.load(Ordering::Relaxed)) {
        return Err(Error::Cancelled { path });
    }

    let mut report = src.report.clone();
    if count_progress {
        report.bytes = src.header.file_len();
        report.read.method = "mmap, converted as read";
    }
    report.converted = converted;
    report.held = Held::Copied;
    drop(src);
    Ok(LoadedFile { path, header, memory, data_base: 0, device: None, report })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_floating_tensors_convert_and_only_to_floating_targets() {
        let t = |dtype| TensorInfo { name: "x".into(), dtype, shape: vec![2], data_offsets: (0, 0) };
        assert!(converts(&t(Dtype::F32), Dtype::BF16));
        assert!(!converts(&t(Dtype::BF16), Dtype::BF16));
        assert!(!converts(&t(Dtype::I64), Dtype::F16));
        assert!(!converts(&t(Dtype::F32), Dtype::I32));
        let e = check_target(Path::new("m.safetensors"), Dtype::I32).unwrap_err().to_string();
        assert!(e.contains("m.safetensors") && e.contains("I32"), "{e}");
    }
}
