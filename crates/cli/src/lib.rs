//! The `turboio` command-line tool, as a library: the `turboio` binary and the Python wheel's
//! `turboio` console script both call [`run`], so one install of either gives the same command.

mod cipher;
mod gpu;
mod out;
mod progress;
mod pt;
mod sigbus;
mod size;

use clap::{FromArgMatches, Parser, Subcommand};
use out::{outln, Shown};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;
use turboio::{parse_direct, CachePolicy, DirectIo, LoadMode, LoadOptions, LoadedFile, SaveOptions};

/// Load, inspect, generate and encrypt safetensors checkpoints as fast as the storage and memory
/// allow.
#[derive(Parser, Debug)]
#[command(name = "turboio", version, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// An option of the object-storage backend (repeatable; see --help).
    ///
    /// For s3://, gs://, az://, abfs[s]:// and http(s):// paths: endpoint=URL, region=R, access_key_id=K,
    /// secret_access_key=S, session_token=T, allow_http=true, concurrency=N (requests in
    /// flight, default 16), part_size=16MiB (bytes per GET / uploaded part, default 8MiB),
    /// max_bandwidth=500MB (bytes per second), max_retries=N, retry_timeout=SECONDS, or any
    /// other object_store key. Without them (and for what they leave out) the environment is
    /// read as each cloud's tools read it: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    /// AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS,
    /// AZURE_STORAGE_ACCOUNT_NAME, ... (prefer the environment for secrets: a command line is
    /// visible to other users).
    #[arg(long = "storage-option", global = true, value_name = "KEY=VALUE", value_parser = parse_key_value, help_heading = "Object storage and the node cache")]
    storage_option: Vec<(String, String)>,
    /// The node cache's directory for remote objects (default: $TURBOIO_CACHE_DIR).
    ///
    /// Node-local cache for s3://, gs://, az:// and http(s):// objects (default:
    /// $TURBOIO_CACHE_DIR, none if unset): the first load of an object version writes it
    /// through to a file here while loading it; later loads of that version read the local
    /// file. Processes loading the same object at once fetch it once. See `turboio cache`.
    #[arg(long = "cache-dir", global = true, value_name = "DIR", help_heading = "Object storage and the node cache")]
    cache_dir: Option<PathBuf>,
    /// Bound on the node cache's size, e.g. 500GB or 2TiB (default: $TURBOIO_CACHE_MAX_SIZE).
    ///
    /// Without it (and $TURBOIO_CACHE_MAX_SIZE) the bound is the file system's free space, of
    /// which 5% is kept free; least recently used entries go first.
    #[arg(long = "cache-max-size", global = true, value_name = "SIZE", value_parser = size::parse_size, help_heading = "Object storage and the node cache")]
    cache_max_size: Option<u64>,
    /// How long the node cache trusts an object's version without asking: 90s, 5m, 1h.
    ///
    /// Trust the version the store reported for an object for this long before asking again
    /// (default: $TURBOIO_CACHE_REVALIDATE, else 0: every load asks, while it reads the cached
    /// copy, and loads again if the object was replaced): within it a cached
    /// object loads with no request to the store, as fast as a local file; an object replaced
    /// meanwhile is noticed when it ends. Seconds, or 90s, 5m, 1h.
    #[arg(long = "cache-revalidate", global = true, value_name = "INTERVAL", value_parser = turboio::cache::parse_interval, help_heading = "Object storage and the node cache")]
    cache_revalidate: Option<std::time::Duration>,
}

impl Cli {
    /// The node cache of `--cache-dir` / `--cache-max-size`, else the environment's.
    fn node_cache(&self) -> Result<Option<turboio::cache::NodeCache>, String> {
        turboio::cache::NodeCache::configured(self.cache_dir.clone(), self.cache_max_size, self.cache_revalidate)
    }
}

fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, not `{s}`")),
    }
}

/// The explicit storage for `path`: the object-storage backend built from `--storage-option`s
/// when there are any and `path` is an object-store URL; else `None` (the scheme registry and
/// the environment decide).
fn storage_for(
    path: &Path,
    object: &Option<Arc<dyn turboio::storage::Storage>>,
) -> Option<Arc<dyn turboio::storage::Storage>> {
    object.as_ref().filter(|_| turboio::object::is_object_url(path)).cloned()
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show a file's or a model's tensors and metadata (only headers are read).
    ///
    /// Show a file's tensors (name, dtype, shape, size) and metadata; only the header is read.
    /// For a model directory (or its index JSON): the shards, tensors, sizes and a dtype
    /// histogram, with the index checked against the shards' headers. For a PyTorch checkpoint
    /// (.pt / .bin, detected by content): its tensors, strides, shared storages and skipped
    /// entries, read without executing its pickle.
    Inspect {
        /// A safetensors file, a .pt / .bin checkpoint, a model directory, or a model's index JSON.
        file: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// .pt checkpoints: only the tensors under this top-level key ("model", "state_dict").
        #[arg(long)]
        top_level_key: Option<String>,
        #[command(flatten)]
        cipher: cipher::ReadCipherArgs,
    },
    /// Load a file or a model as the library does, and report the speed.
    ///
    /// Load every tensor into memory exactly as the library does and report the speed. A model
    /// directory (or its index JSON) is loaded as one job: every shard validated first, then all
    /// shards read in one pipeline. A PyTorch checkpoint (.pt / .bin, detected by content) is
    /// loaded through the same pipeline without executing its pickle.
    Load {
        /// A safetensors file, a .pt / .bin checkpoint, a model directory, or a model's index JSON
        /// (model.safetensors.index.json).
        file: PathBuf,
        /// .pt checkpoints: only the tensors under this top-level key ("model", "state_dict").
        #[arg(long)]
        top_level_key: Option<String>,
        /// Reader threads (0 = one per core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Page-cache policy: keep, bypass or auto (not the node cache: see --cache-dir).
        ///
        /// Page cache: keep (read through it, so the next load of the file is hot), bypass
        /// (O_DIRECT; copied loads only; the cache is left as it was), auto (keep unless the
        /// file and its copy do not both fit in available memory).
        #[arg(long = "page-cache", visible_alias = "cache", value_name = "POLICY", default_value = "auto")]
        cache: CachePolicy,
        /// Older spelling of --cache: on = bypass, off = keep, auto = auto.
        #[arg(long, hide = true, value_parser = parse_direct, conflicts_with = "cache")]
        direct: Option<DirectIo>,
        /// How to hold the bytes: auto (mapped when the page cache is kept and the file can be
        /// mapped, else copied), mapped (zero copy from the page cache), copied (a private arena),
        /// lazy (mapped, nothing read until touched).
        #[arg(long, default_value = "auto")]
        mode: LoadMode,
        /// Transparent huge pages for copied loads: on, off (default: TURBOIO_HUGE_PAGES, else off
        /// for a fresh arena and on for --reuse-arena, which fills faster with them).
        #[arg(long, value_parser = parse_on_off)]
        huge_pages: Option<bool>,
        /// Load this many times (each load is dropped before the next); at least 1.
        #[arg(long, default_value_t = 1, value_parser = parse_count)]
        repeat: usize,
        /// Reuse one arena across repeats (veTurboIO's init_io_helper).
        #[arg(long)]
        reuse_arena: bool,
        /// Compare every tensor's bytes with a plain read of the file.
        #[arg(long)]
        check: bool,
        /// Convert every floating tensor to this dtype on the way in (bf16, f16, f32, f64,
        /// f8_e4m3, f8_e5m2, or torch's names: bfloat16, float16...), bit-identical to torch's
        /// `.to()`; other tensors pass through.
        #[arg(long, value_parser = parse_dtype)]
        dtype: Option<turboio::Dtype>,
        /// Load only the tensors this name or glob pattern matches (`*` any run of characters,
        /// `?` one, `[a-z]` a class; quote it from the shell); repeatable. Only their bytes are
        /// read (a model's shards that hold none are not opened); a pattern that matches nothing
        /// is an error naming the closest tensors.
        #[arg(long = "tensors", value_name = "PATTERN")]
        tensors: Vec<String>,
        /// A budget of host memory (e.g. 8GiB) for what the load allocates (copies, converted
        /// arenas, pinned staging): a load that needs more fails before allocating anything,
        /// saying what it needs and what would fit. Without it the limit is the memory available
        /// (MemAvailable, or less in a memory cgroup with a limit). Mapped loads allocate none.
        #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
        max_host_memory: Option<u64>,
        /// A budget of device memory for a load into a GPU (without it: the device's free memory).
        #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
        max_device_memory: Option<u64>,
        #[command(flatten)]
        cipher: cipher::ReadCipherArgs,
        #[command(flatten)]
        gpu: gpu::GpuArgs,
    },
    /// Convert a PyTorch checkpoint (a file or a model directory) to safetensors, executing nothing.
    ///
    /// Convert a PyTorch checkpoint (.pt / .bin) to safetensors without executing its pickle,
    /// streaming (memory stays near the writers' chunks, not the checkpoint) and atomically. A
    /// directory of shards (with pytorch_model.bin.index.json, or the index itself) becomes a
    /// safetensors model directory (model-0000N-of-0000M.safetensors + model.safetensors.index.json).
    /// Tensors that are the same view of one storage (tied weights) are stored once, the others
    /// recorded as aliases in __metadata__ (or copied with --clone-shared).
    Convert {
        /// The .pt / .bin file, a directory of them, or pytorch_model.bin.index.json.
        input: PathBuf,
        /// The .safetensors file (for a directory input: the model directory) to write.
        output: PathBuf,
        /// Read the output back and compare every tensor with the input.
        #[arg(long)]
        validate_result: bool,
        /// Convert every floating tensor to this dtype (bf16, f16, f32, ...; bit-identical to
        /// torch's `.to()`).
        #[arg(long, value_parser = parse_dtype)]
        dtype: Option<turboio::Dtype>,
        /// Only the tensors under this top-level key of a nested checkpoint ("model", "state_dict").
        #[arg(long)]
        top_level_key: Option<String>,
        /// Store a copy of every tied tensor instead of aliases.
        #[arg(long)]
        clone_shared: bool,
        /// Replace an existing output.
        #[arg(long)]
        overwrite: bool,
        /// Reader and writer threads (0 = one per core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        #[command(flatten)]
        cipher: cipher::ReadCipherArgs,
    },
    /// Write a realistic sample checkpoint (mixed dtypes, random data).
    Gen {
        /// Output file (with --shards: the model directory).
        out: PathBuf,
        /// Write a sharded model directory of this many shards (one per tensor if the sample
        /// has fewer tensors), with its model.safetensors.index.json, instead of one file.
        #[arg(long, value_parser = parse_count)]
        shards: Option<usize>,
        /// Approximate size, e.g. 4GiB, 512MiB, 100MB, 123456 (at least the smallest sample, about 362 KiB).
        #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = size::parse_size, allow_hyphen_values = true)]
        size: u64,
        /// Seed of the random data.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[command(flatten)]
        cipher: cipher::CipherArgs,
    },
    /// Encrypt a file (safetensors or .pt) in veTurboIO's AES-CTR format, atomically.
    Encrypt {
        /// The plain file.
        input: PathBuf,
        /// The encrypted file to write.
        output: PathBuf,
        #[command(flatten)]
        cipher: cipher::CipherArgs,
    },
    /// Decrypt a file written by `turboio encrypt`, veTurboIO or the CLI's --cipher options.
    Decrypt {
        /// The encrypted file.
        input: PathBuf,
        /// The plain file to write (left untouched unless the decrypted file is valid).
        output: PathBuf,
        #[command(flatten)]
        cipher: cipher::ReadCipherArgs,
    },
    /// List, size or prune the node cache of remote objects (--cache-dir, $TURBOIO_CACHE_DIR).
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// Generate a sample checkpoint and print a load table (mapped, copied, auto vs std::fs::read).
    Demo {
        /// Size of the sample, e.g. 1GiB or 500MB.
        #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = size::parse_size, allow_hyphen_values = true)]
        size: u64,
        /// Where to put the sample (default: target/turboio-demo under the current directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Runs per loader (the median is shown); at least 1.
        #[arg(long, default_value_t = 5, value_parser = parse_count)]
        runs: usize,
    },
}

#[derive(Subcommand, Debug)]
enum CacheAction {
    /// The entries, most recently used first: size, last use, URL and version.
    Ls {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The number of entries and their total size.
    Du,
    /// Remove least recently used entries, down to --max-size (all without it).
    ///
    /// Removes least recently used entries until the cache holds at most --max-size (all of
    /// them without it), and what fetches that died left behind. Loads that have an entry
    /// open keep reading it.
    Prune {
        /// The size to prune down to, e.g. 50GiB or 200GB.
        #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
        max_size: Option<u64>,
    },
}

/// The global options that mean nothing to `turboio cache` (it reads the directory only): kept
/// there (a command line may give them before any subcommand) but left out of its help.
const NOT_FOR_CACHE: [&str; 3] = ["storage_option", "cache_max_size", "cache_revalidate"];

/// The command line's definition, with the global options that mean nothing to `cache` hidden
/// from its help and its subcommands': a hidden copy of each is given to `cache` (clap then
/// propagates the copy, not the original, below it).
fn command() -> clap::Command {
    use clap::CommandFactory;
    let cmd = Cli::command();
    let hidden: Vec<clap::Arg> = cmd
        .get_arguments()
        .filter(|a| NOT_FOR_CACHE.contains(&a.get_id().as_str()))
        .map(|a| a.clone().hide(true))
        .collect();
    cmd.mut_subcommand("cache", |c| c.args(hidden))
}

/// The command with this process's arguments (the binary's `main`).
pub fn main() -> ExitCode {
    ExitCode::from(run(std::env::args_os()))
}

/// Runs the command line `args` (its first item is the program's name) and gives the exit
/// status: 0 on success, 1 on an error (printed to stderr, one line), 2 on a usage error (clap's
/// message), `out::CLOSED_STATUS` when stdout was closed early. `--help` and `--version` print
/// and give 0.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match command().try_get_matches_from(args).and_then(|m| Cli::from_arg_matches(&m)) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with status 0, usage errors to stderr with 2.
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let cache = match cli.node_cache() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("turboio: error: {e}");
            return 1;
        }
    };
    let object: Option<Arc<dyn turboio::storage::Storage>> = if cli.storage_option.is_empty() && cli.cache_dir.is_none()
    {
        // The scheme registry reads the environment (the cache's included).
        None
    } else {
        match turboio::object::ObjectOptions::from_pairs(cli.storage_option.iter().map(|(k, v)| (k, v))) {
            Ok(o) => {
                let object: Arc<dyn turboio::storage::Storage> = if cli.storage_option.is_empty() {
                    Arc::new(turboio::object::ObjectStorage::global())
                } else {
                    Arc::new(turboio::object::ObjectStorage::new(o))
                };
                Some(match &cache {
                    Some(c) => Arc::new(turboio::cache::CacheStorage::new(object, c.clone())),
                    None => object,
                })
            }
            Err(e) => {
                eprintln!("turboio: error: --storage-option: {e}");
                return 1;
            }
        }
    };
    let result = match cli.command {
        Command::Inspect { file, json, top_level_key, cipher } => {
            cipher.encryption().map_err(Into::into).and_then(|encryption| {
                let opts = LoadOptions { encryption, storage: storage_for(&file, &object), ..Default::default() };
                if !is_model(&file) && pt::is_pt(&file, &opts) {
                    pt::inspect(&file, json, &opts, top_level_key.as_deref())
                } else {
                    inspect(&file, json, &opts)
                }
            })
        }
        Command::Load {
            file,
            top_level_key,
            threads,
            cache,
            direct,
            mode,
            huge_pages,
            repeat,
            reuse_arena,
            check,
            dtype,
            tensors,
            max_host_memory,
            max_device_memory,
            cipher,
            gpu,
        } => cipher.encryption().map_err(Into::into).and_then(|encryption| {
            let cache = direct.map_or(cache, CachePolicy::from);
            let storage = storage_for(&file, &object);
            let tensors = if tensors.is_empty() { None } else { Some(turboio::Selection::patterns(tensors)?) };
            let opts = LoadOptions {
                threads,
                cache,
                mode,
                huge_pages,
                encryption,
                dtype,
                storage,
                tensors,
                max_host_memory,
                max_device_memory,
                ..Default::default()
            };
            gpu.apply(opts).and_then(|opts| {
                if !is_model(&file) && pt::is_pt(&file, &opts) {
                    pt::load(&file, opts, repeat, check, top_level_key.as_deref())
                } else {
                    load(&file, opts, repeat, reuse_arena, check)
                }
            })
        }),
        Command::Convert {
            input,
            output,
            validate_result,
            dtype,
            top_level_key,
            clone_shared,
            overwrite,
            threads,
            cipher,
        } => cipher.encryption().map_err(Into::into).and_then(|encryption| {
            let opts = LoadOptions { encryption, storage: storage_for(&input, &object), ..Default::default() };
            let save = SaveOptions { threads, storage: storage_for(&output, &object), ..Default::default() };
            pt::convert(&input, &output, &opts, save, top_level_key, clone_shared, dtype, validate_result, overwrite)
        }),
        Command::Gen { out, shards, size, seed, cipher } => {
            let storage = storage_for(&out, &object);
            cipher.encryption().map_err(Into::into).and_then(|encryption| match shards {
                Some(n) => gen_model(&out, n, size, seed, encryption, storage),
                None => gen(&out, size, seed, encryption, storage),
            })
        }
        Command::Encrypt { input, output, cipher } => cipher::encrypt(&input, &output, &cipher),
        Command::Decrypt { input, output, cipher } => cipher::decrypt(&input, &output, &cipher),
        Command::Cache { action } => cache_command(cache, action),
        Command::Demo { size, dir, runs } => demo(size, dir, runs),
    };
    // Files replaced by saves are deleted in the background: gone before the process is.
    turboio::wait_for_saves();
    match result {
        Ok(()) => 0,
        Err(e) if e.is::<out::Closed>() => out::CLOSED_STATUS,
        Err(e) => {
            // A memory plan's refusal names this command's flags as its remedies.
            match e.downcast_ref::<turboio::Error>() {
                Some(e) => eprintln!("turboio: error: {}", e.describe_for(turboio::memory::Api::Cli)),
                None => eprintln!("turboio: error: {e}"),
            }
            1
        }
    }
}

type CliResult = Result<(), Box<dyn std::error::Error>>;

fn gb(bytes: u64) -> String {
    turboio::inspect::human_bytes(bytes)
}

/// "; node cache: hit" when a node cache served the file.
fn node_cache(r: &turboio::LoadReport) -> String {
    r.served_by.map(|s| format!("; {s}")).unwrap_or_default()
}

/// The bytes of the node cache's entries, as sizes are shown everywhere.
fn total(entries: &[turboio::cache::Entry]) -> String {
    gb(entries.iter().map(|e| e.len).sum::<u64>())
}

/// Seconds ago as "12 s ago", "5 min ago", "3 h ago", "2 d ago".
fn ago_text(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s} s ago"),
        s if s < 2 * 3600 => format!("{} min ago", s / 60),
        s if s < 2 * 86400 => format!("{} h ago", s / 3600),
        s => format!("{} d ago", s / 86400),
    }
}

/// `--repeat` and `--runs`: a count of at least 1.
fn parse_count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a whole number (at least 1)")),
    }
}

/// Whether a path names a model (a directory or an index JSON) rather than one file. An
/// object-store URL without a checkpoint's extension is a model "directory" (a key prefix).
fn is_model(path: &Path) -> bool {
    path.is_dir()
        || path.extension().is_some_and(|e| e == "json")
        || (turboio::object::is_object_url(path) && !turboio::model::names_a_checkpoint_file(path))
}

fn inspect(file: &Path, json: bool, opts: &LoadOptions) -> CliResult {
    if is_model(file) {
        return inspect_model(file, json, opts);
    }
    let header = turboio::read_header_of(file, opts)?;
    if json {
        let tensors: Vec<serde_json::Value> = header
            .tensors()
            .iter()
            .map(|t| {
                serde_json::json!({
                    "name": t.name,
                    "dtype": t.dtype.name(),
                    "shape": t.shape,
                    "data_offsets": [t.data_offsets.0, t.data_offsets.1],
                    "bytes": t.len(),
                })
            })
            .collect();
        let aliases: serde_json::Map<String, serde_json::Value> =
            header.aliases().into_iter().map(|(a, t)| (a.to_owned(), t.into())).collect();
        let doc = serde_json::json!({
            "path": file.shown().to_string(),
            "file_len": header.file_len(),
            "header_len": header.header_len(),
            "data_len": header.data_len(),
            "metadata": header.metadata(),
            "aliases": aliases,
            "tensors": tensors,
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    let mut line = |l: &str| out::line(format_args!("{l}"));
    turboio::inspect::table(file, &header, &mut line)
}

/// A dtype by its safetensors name or torch's (`bf16`, `BF16`, `bfloat16`, `torch.float16`...).
fn parse_dtype(s: &str) -> Result<turboio::Dtype, String> {
    let name = s.trim().trim_start_matches("torch.").to_ascii_lowercase();
    let canonical = match name.as_str() {
        "float64" | "double" | "fp64" => "F64",
        "float32" | "float" | "fp32" => "F32",
        "float16" | "half" | "fp16" => "F16",
        "bfloat16" => "BF16",
        "float8_e4m3fn" | "fp8_e4m3" => "F8_E4M3",
        "float8_e5m2" | "fp8_e5m2" => "F8_E5M2",
        other => return other.to_ascii_uppercase().parse().map_err(|e| format!("{e}")),
    };
    canonical.parse().map_err(|e| format!("{e}"))
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        other => Err(format!("expected on or off, not `{other}`")),
    }
}

fn load(file: &Path, mut opts: LoadOptions, repeat: usize, reuse_arena: bool, check: bool) -> CliResult {
    if is_model(file) {
        return load_model(file, opts, repeat, check);
    }
    sigbus::report_for(file);
    if reuse_arena {
        let huge = opts.huge_pages.unwrap_or_else(turboio::device::pool_huge_pages);
        opts.arenas = Some(turboio::device::ArenaPool::with_huge_pages(1, huge));
    }
    // A remote file's length: asked for first when a bar shows it (its opening GET, which a
    // node cache may serve), else known once loaded.
    let mut file_len = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    if file_len == 0 && progress::shown() {
        file_len = turboio::read_header_of(file, &opts).map_or(0, |h| h.file_len());
    }
    let mut rate_bytes = 0u64;
    let mut times = Vec::new();
    for run in 1..=repeat {
        let bar = progress::Bar::start(file_len, &format!("loading {}", file.shown()));
        opts.progress = bar.counter();
        let loaded = turboio::load(file, &opts);
        bar.finish();
        let loaded = loaded?;
        if file_len == 0 {
            file_len = loaded.header().file_len();
        }
        let r = loaded.report();
        times.push(r.elapsed.as_secs_f64());
        let cached = r.cached_fraction.map(|f| format!(", {:.0}% cached before", f * 100.0)).unwrap_or_default();
        let direct = if r.read.direct {
            " O_DIRECT"
        } else if r.read.direct_refused {
            " (O_DIRECT refused)"
        } else {
            ""
        };
        let converted = match (opts.dtype, r.converted) {
            (Some(d), n) if n > 0 => format!(", {n} tensors converted to {d}"),
            _ => String::new(),
        };
        // Where a node cache served it from, when one did (issue 49, item 12).
        let served = r.served_by.map(|s| format!("; {s}")).unwrap_or_default();
        // A selection reads part of the file: the size and rate are of what it read.
        let (what, bytes) = match opts.tensors {
            Some(_) => (format!(" selected, {} of {} read", gb(r.bytes), gb(file_len)), r.bytes),
            None => (format!(", {}", gb(file_len)), file_len),
        };
        rate_bytes = bytes;
        outln!(
            "run {run}: {}{what} in {:.3} s = {:.2} GB/s ({}, {}{}{}{}{converted}; {}{served})",
            count(loaded.len(), "tensor", "{n} tensors"),
            r.elapsed.as_secs_f64(),
            r.gb_per_s(bytes),
            r.held,
            r.read.method,
            direct,
            if r.arena_reused { ", arena reused" } else { "" },
            cached,
            r.cache,
        );
        for why in &r.fallbacks {
            println!("  fallback: {why}");
        }
        if check {
            check_against_plain_read(&loaded, &opts)?;
        }
    }
    if times.len() > 1 {
        let runs = times.len();
        let m = median(times);
        outln!("median of {runs} runs: {m:.3} s = {:.2} GB/s", rate_bytes as f64 / m / 1e9);
    }
    Ok(())
}

fn check_against_plain_read(loaded: &LoadedFile, opts: &LoadOptions) -> CliResult {
    let plain = match &opts.encryption {
        // The reference for an encrypted file: the whole file decrypted in one plain pass.
        Some(enc) => turboio::read_all(
            loaded.path(),
            &LoadOptions { encryption: Some(enc.clone()), cache: CachePolicy::Keep, ..Default::default() },
        )?,
        None if opts.storage.is_some() || turboio::object::is_object_url(loaded.path()) => turboio::read_all(
            loaded.path(),
            &LoadOptions { storage: opts.storage.clone(), cache: CachePolicy::Keep, ..Default::default() },
        )?,
        None => {
            std::fs::read(loaded.path()).map_err(|e| format!("{}: plain read failed: {e}", loaded.path().shown()))?
        }
    };
    let path = loaded.path().shown();
    let header = loaded.header();
    // The plain read must be of the file that was loaded: same length, same header bytes. A
    // file rewritten in between is reported as such, never sliced by the old header's offsets.
    let changed = |why: String| format!("{path}: the file changed during the check ({why}); nothing was compared");
    if opts.dtype.is_none() && opts.tensors.is_none() && plain.len() as u64 != header.file_len() {
        return Err(changed(format!(
            "it had {} bytes when loaded and {} when read again",
            header.file_len(),
            plain.len()
        ))
        .into());
    }
    let again = match turboio::Header::parse(&plain, plain.len() as u64) {
        Ok(again) if again == *header || (opts.dtype.is_some() && again.sorted_names() == header.sorted_names()) => {
            again
        }
        // A selected load holds some of the file's tensors, each as the file describes it.
        Ok(again)
            if opts.tensors.is_some()
                && header.tensors().iter().all(|t| {
                    again
                        .get(&t.name)
                        .is_some_and(|o| o.shape == t.shape && (o.dtype == t.dtype || opts.dtype.is_some()))
                }) =>
        {
            again
        }
        _ => return Err(changed("its header is not the one that was loaded".into()).into()),
    };
    let start = again.data_start() as usize;
    for t in loaded.tensors() {
        let original = again.tensor(t.name()).map_err(|e| format!("{path}: {e}"))?;
        let (b, e) = original.data_offsets;
        let mut expect = plain[start + b..start + e].to_vec();
        if original.dtype != t.dtype() {
            // A converting load: the reference is the plain bytes converted on their own.
            let mut out = vec![0u8; t.len()];
            turboio::format::cast(&expect, original.dtype, t.dtype(), &mut out)
                .map_err(|e| format!("{path}: tensor `{}`: {e}", t.name()))?;
            expect = out;
        }
        let got = loaded.to_host(t.name())?;
        if got != expect {
            return Err(format!(
                "{path}: tensor `{}` differs from a plain read (was the file rewritten in place while loaded?)",
                t.name()
            )
            .into());
        }
    }
    let what = if turboio::object::is_object_url(loaded.path()) { "object" } else { "file" };
    let matched = count(loaded.len(), "tensor matches", "all {n} tensors match");
    outln!("check: {path}: {matched} a plain read of the {what}");
    Ok(())
}

fn gen(
    out: &Path,
    size: u64,
    seed: u64,
    encryption: Option<turboio::crypt::Encryption>,
    storage: Option<Arc<dyn turboio::storage::Storage>>,
) -> CliResult {
    let min = turboio::sample::min_sample_size();
    if size < min {
        return Err(format!(
            "{}: --size {size} is below the smallest sample, {min} bytes ({} KiB); give at least that",
            out.shown(),
            min.div_ceil(1024)
        )
        .into());
    }
    let bar = progress::Bar::start(size, &format!("writing {}", out.shown()));
    let read_back = storage.clone();
    let opts = SaveOptions { progress: bar.counter(), encryption, storage, ..Default::default() };
    let start = Instant::now();
    let result = turboio::sample::write_sample(out, size, seed, &opts);
    bar.finish();
    let tensors = result?;
    let len = match std::fs::metadata(out) {
        Ok(m) => m.len(),
        // An object written to a store: its length from its header.
        Err(_) => turboio::read_header_of(out, &LoadOptions { storage: read_back, ..Default::default() })?.file_len(),
    };
    let secs = start.elapsed().as_secs_f64();
    outln!(
        "wrote {}: {}, {} in {:.2} s ({}/s)",
        out.shown(),
        count(tensors.len(), "tensor", "{n} tensors"),
        gb(len),
        secs,
        gb((len as f64 / secs.max(1e-9)) as u64)
    );
    Ok(())
}

fn inspect_model(path: &Path, json: bool, opts: &LoadOptions) -> CliResult {
    let files = turboio::ModelFiles::resolve_in(path, opts.storage.as_ref())?;
    let summary = turboio::model::summarize(&files, opts)?;
    if json {
        let shards: Vec<serde_json::Value> = summary
            .shards
            .iter()
            .map(|(p, n, b)| serde_json::json!({"path": p.shown().to_string(), "tensors": n, "bytes": b}))
            .collect();
        let dtypes: serde_json::Map<String, serde_json::Value> = summary
            .dtypes
            .iter()
            .map(|(d, (n, b))| (d.clone(), serde_json::json!({"tensors": n, "bytes": b})))
            .collect();
        let doc = serde_json::json!({
            "path": path.shown().to_string(),
            "index": files.index.as_ref().map(|p| p.shown().to_string()),
            "metadata": files.metadata,
            "tensors": summary.tensors(),
            "bytes": summary.bytes(),
            "shards": shards,
            "dtypes": dtypes,
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    let index = files.index.as_ref().map(|p| format!(" (index {})", p.shown())).unwrap_or_default();
    outln!(
        "{}: {}, {} in {}{index}",
        path.shown(),
        count(summary.tensors(), "tensor", "{n} tensors"),
        gb(summary.bytes()),
        count(summary.shards.len(), "shard", "{n} shards")
    );
    outln!("shards:");
    let mut shards: Vec<&(PathBuf, usize, u64)> = summary.shards.iter().collect();
    shards.sort_by(|a, b| a.0.cmp(&b.0));
    for (p, n, b) in shards {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        outln!("  {name}  {}  {}", count(*n, "tensor", "{n} tensors"), gb(*b));
    }
    outln!("dtypes:");
    for (d, (n, b)) in &summary.dtypes {
        outln!("  {d:<12} {:>13}  {}", count(*n, "tensor", "{n} tensors"), gb(*b));
    }
    Ok(())
}

fn load_model(path: &Path, mut opts: LoadOptions, repeat: usize, check: bool) -> CliResult {
    // The bar's total: local shards' sizes. A remote model's are known once its shards are
    // opened (its bar counts without a total): resolving it here would cost the load a request
    // before it starts (and, with a node cache, ask for the index before the load reads it).
    let mut total: u64 = if path.to_string_lossy().contains("://") {
        0
    } else {
        let files = turboio::ModelFiles::resolve_in(path, opts.storage.as_ref())?;
        files.shards.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum()
    };
    let mut rate_bytes = 0u64;
    let mut times = Vec::new();
    for run in 1..=repeat {
        let bar = progress::Bar::start(total, &format!("loading {}", path.shown()));
        opts.progress = bar.counter();
        let loaded = turboio::load_model(path, &opts);
        bar.finish();
        let loaded = loaded?;
        let r = loaded.report();
        if total == 0 {
            total = r.bytes;
        }
        times.push(r.elapsed.as_secs_f64());
        let mut how: Vec<String> = loaded
            .shard_reports()
            .map(|s| format!("{}, {}; {}{}", s.held, s.read.method, s.cache, node_cache(s)))
            .collect();
        how.sort();
        how.dedup();
        // A selection reads part of the model: the size and the rate are of what it read, as
        // for a file (issue 49, item 10).
        let (tensors, shards) = (count(loaded.len(), "tensor", "{n} tensors"), count(r.files, "shard", "{n} shards"));
        let (what, bytes) = match opts.tensors {
            Some(_) => (format!("{tensors} selected from {shards}, {} of {} read", gb(r.bytes), gb(total)), r.bytes),
            None => (format!("{tensors} in {shards}, {}", gb(total)), total),
        };
        rate_bytes = bytes;
        outln!(
            "run {run}: {what} in {:.3} s = {:.2} GB/s ({} at a time x {} threads; {})",
            r.elapsed.as_secs_f64(),
            bytes as f64 / r.elapsed.as_secs_f64().max(1e-9) / 1e9,
            count(r.workers, "shard", "{n} shards"),
            r.threads_per_fill,
            how.join(" | "),
        );
        for s in loaded.shard_reports() {
            for why in &s.fallbacks {
                println!("  fallback: {why}");
            }
        }
        if check {
            let mut shards: Vec<&LoadedFile> = loaded.shards().iter().collect();
            shards.sort_by(|a, b| a.path().cmp(b.path()));
            for shard in shards {
                check_against_plain_read(shard, &opts)?;
            }
        }
    }
    if times.len() > 1 {
        let runs = times.len();
        let m = median(times);
        outln!("median of {runs} runs: {m:.3} s = {:.2} GB/s", rate_bytes as f64 / m / 1e9);
    }
    Ok(())
}

/// `gen --shards N`: a sample of `size` bytes written as a model directory of N shards (one per
/// tensor if it has fewer).
fn gen_model(
    dir: &Path,
    shards: usize,
    size: u64,
    seed: u64,
    encryption: Option<turboio::crypt::Encryption>,
    storage: Option<Arc<dyn turboio::storage::Storage>>,
) -> CliResult {
    let min = turboio::sample::min_sample_size();
    if size < min {
        return Err(format!(
            "{}: --size {size} is below the smallest sample, {min} bytes; give at least that",
            dir.shown()
        )
        .into());
    }
    let remote = turboio::object::is_object_url(dir);
    if !remote {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: cannot create the directory: {e}", dir.shown()))?;
    }
    let start = Instant::now();
    // The sample is written once as a single local file (beside the shards, or in the temporary
    // directory for a remote model), then split.
    let single = if remote {
        std::env::temp_dir().join(format!(".turboio-gen-sample.{}.safetensors", std::process::id()))
    } else {
        dir.join(".turboio-gen-sample.safetensors")
    };
    turboio::sample::write_sample(&single, size, seed, &SaveOptions::default())?;
    let result = (|| -> CliResult {
        let loaded = turboio::load(&single, &LoadOptions::default())?;
        let list: Vec<turboio::SaveTensor<'_>> = loaded
            .tensors()
            .map(|t| turboio::SaveTensor {
                name: t.name(),
                dtype: t.dtype(),
                shape: t.shape(),
                data: t.bytes().unwrap_or(&[]),
            })
            .collect();
        let groups = even_groups(&list.iter().map(|t| t.data.len() as u64).collect::<Vec<_>>(), shards);
        let report = turboio::save_model_dir_grouped(
            dir,
            &list,
            &groups,
            None,
            &SaveOptions { encryption, storage, ..Default::default() },
        )?;
        outln!(
            "wrote {}: {} in {}, {} in {:.2} s",
            dir.shown(),
            count(list.len(), "tensor", "{n} tensors"),
            count(report.shards.len(), "shard", "{n} shards"),
            gb(report.total_size),
            start.elapsed().as_secs_f64()
        );
        Ok(())
    })();
    let _ = std::fs::remove_file(&single);
    result
}

/// `sizes` (in order) cut into `n` consecutive groups of about equal bytes: exactly `n` when
/// there are at least `n` items, else one per item. (`gen --shards 4` wrote 5 shards when it
/// packed greedily up to a quarter of the bytes each.)
fn even_groups(sizes: &[u64], n: usize) -> Vec<Vec<usize>> {
    let len = sizes.len();
    let n = n.clamp(1, len.max(1));
    let total = sizes.iter().sum::<u64>().max(1);
    let mut groups: Vec<Vec<usize>> = Vec::with_capacity(n);
    let mut acc = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        // The share of the bytes this item's middle falls in; never behind the current group,
        // never skipping one, and early enough that the items left fill the groups left.
        let by_bytes = ((acc + size / 2) as u128 * n as u128 / total as u128) as usize;
        let lowest = n.saturating_sub(len - i);
        let g = match groups.len() {
            0 => 0,
            made => by_bytes.max(lowest).clamp(made - 1, made.min(n - 1)),
        };
        if g == groups.len() {
            groups.push(Vec::new());
        }
        groups[g].push(i);
        acc += size;
    }
    groups
}

/// The median of `v` (of an even count, the mean of the middle two).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// `n` things: "1 tensor", "3 tensors"; `many` (with `{n}`) for more than one.
pub(crate) fn count(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        many.replace("{n}", &n.to_string())
    }
}

fn demo(size: u64, dir: Option<PathBuf>, runs: usize) -> CliResult {
    let dir = dir.unwrap_or_else(|| PathBuf::from("target/turboio-demo"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.shown()))?;
    let path = dir.join(format!("sample-{}.safetensors", size::format_size(size)));
    if std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) < size {
        gen(&path, size, 0, None, None)?;
    }
    let len = std::fs::metadata(&path)?.len();
    let header = turboio::read_header_of(&path, &LoadOptions::default())?;
    outln!(
        "\nsample: {} ({} tensors, {}), page cache warm, median of {runs} runs\n",
        path.shown(),
        header.len(),
        gb(len)
    );
    let loaders: Vec<(&str, LoadMode)> = vec![
        ("turboio auto", LoadMode::Auto),
        ("turboio mapped", LoadMode::Mapped),
        ("turboio copied", LoadMode::Copied),
    ];
    let mut results: Vec<(String, Vec<f64>, String)> =
        loaders.iter().map(|(n, _)| (n.to_string(), vec![], String::new())).collect();
    results.push(("std::fs::read".into(), vec![], "one read into a Vec".into()));
    // Warm the cache once, then alternate loaders run by run.
    drop(std::fs::read(&path)?);
    for _ in 0..runs {
        for (i, (_, mode)) in loaders.iter().enumerate() {
            let opts = LoadOptions { mode: *mode, ..Default::default() };
            let loaded = turboio::load(&path, &opts)?;
            let r = loaded.report();
            results[i].1.push(r.elapsed.as_secs_f64());
            results[i].2 = format!("{} via {}", r.held, r.read.method);
        }
        let t = Instant::now();
        let v = std::fs::read(&path)?;
        results[loaders.len()].1.push(t.elapsed().as_secs_f64());
        drop(v);
    }
    let base = median(results[loaders.len()].1.clone());
    outln!("| loader | seconds | GB/s | vs std::fs::read | how |");
    outln!("|---|---:|---:|---:|---|");
    for (name, times, how) in &results {
        let m = median(times.clone());
        outln!("| {name} | {m:.3} | {:.2} | {:.1}x | {how} |", len as f64 / m / 1e9, base / m);
    }
    outln!("\nMore: `turboio load FILE --check`, `turboio inspect FILE`, `cargo xtask bench` (hot and cold, all baselines).");
    Ok(())
}

fn cache_command(
    cache: Option<turboio::cache::NodeCache>,
    action: CacheAction,
) -> Result<(), Box<dyn std::error::Error>> {
    let cache = cache.ok_or("no cache directory: pass --cache-dir DIR or set TURBOIO_CACHE_DIR")?;
    let dir = cache.dir().shown().to_string();
    let entries = || cache.entries().map_err(|e| format!("{dir}: {e}"));
    match action {
        CacheAction::Ls { json } => {
            let entries = entries()?;
            let since = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            if json {
                let list: Vec<_> = entries
                    .iter()
                    .map(|e| {
                        serde_json::json!({
                            "url": e.url, "version": e.version, "bytes": e.len,
                            "last_used_unix": since(e.last_used), "path": e.path, "key": e.key,
                        })
                    })
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                let now = std::time::SystemTime::now();
                if !entries.is_empty() {
                    outln!("{:>10}  {:>10}  URL  (VERSION)", "SIZE", "LAST USED");
                }
                for e in &entries {
                    let ago = now.duration_since(e.last_used).map_or(0, |d| d.as_secs());
                    outln!("{:>10}  {:>10}  {}  ({})", gb(e.len), ago_text(ago), e.url, e.version);
                }
                outln!("{}, {} in {dir}", count(entries.len(), "entry", "{n} entries"), total(&entries));
            }
        }
        CacheAction::Du => {
            let entries = entries()?;
            outln!("{}, {} in {dir}", count(entries.len(), "entry", "{n} entries"), total(&entries));
        }
        CacheAction::Prune { max_size } => {
            let r = cache.prune(max_size.unwrap_or(0)).map_err(|e| format!("{dir}: {e}"))?;
            outln!(
                "removed {} ({}) and {} from {dir}",
                count(r.removed, "entry", "{n} entries"),
                gb(r.freed),
                count(r.stale_parts, "unfinished fetch", "{n} unfinished fetches")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn even_groups_make_exactly_the_shards_asked_for() {
        for sizes in [vec![10u64; 7], vec![1, 100, 1, 1, 100, 1, 5, 5, 5, 300], vec![0; 5], vec![50, 1, 1, 1]] {
            for n in 1..=sizes.len() + 2 {
                let g = super::even_groups(&sizes, n);
                assert_eq!(g.len(), n.min(sizes.len()), "{sizes:?} into {n}: {g:?}");
                let flat: Vec<usize> = g.iter().flatten().copied().collect();
                assert_eq!(flat, (0..sizes.len()).collect::<Vec<_>>(), "{sizes:?} into {n}: in order, each once");
            }
        }
        assert_eq!(super::median(vec![3.0, 0.5]), 1.75);
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::count(1, "tensor", "{n} tensors"), "1 tensor");
    }
}
