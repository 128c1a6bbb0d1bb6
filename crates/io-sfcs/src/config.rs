//! SFCS configuration, as veTurboIO builds it (`sfcs_utils.py`): cache policies from
//! `SFCS_METAINFO_PATH`, credentials from `CREDENTIAL_PATH`, the RDMA network from
//! `MLP_RDMA_*`, per-field `SFCS_*` overrides, the same validation errors, the same
//! properties, and the Hadoop-style XML libcloudfs reads.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use turboio_kms::{DatapipeConfig, Secret};
use zeroize::Zeroizing;

/// veTurboIO's default cache-policy file (`SFCS_METAINFO_PATH`).
pub const DEFAULT_METAINFO_PATH: &str = "/root/.volc/SFCSConfiguration.json";
/// veTurboIO's default credential directory (`CREDENTIAL_PATH`).
pub const DEFAULT_CREDENTIAL_PATH: &str = "/mlplatform/.credential/";
/// veTurboIO's default RDMA NIC (`MLP_RDMA_NIC_NAMES`).
pub const DEFAULT_NIC: &str = "eth0";

/// A look-up of environment variables (unset and empty both `None`).
pub type Vars = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The process environment as [`Vars`].
pub fn process_vars() -> Vars {
    Arc::new(|k: &str| std::env::var(k).ok().filter(|v| !v.is_empty()))
}

/// A cache policy of the `SFCS_METAINFO_PATH` file (`{"cache_policies": {key: policy}}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CachePolicy {
    /// The local mount path the policy's paths start with.
    pub mount_path: String,
    /// The SFCS directory the mount path maps to (empty: no mapping).
    pub cache_prefix: String,
    /// `dfs.authentication.service.name`.
    pub authentication_service_name: String,
    /// `"true"` to resolve addresses by DNS.
    pub enable_dns: String,
    /// The file system name.
    pub sfcs_fs_name: String,
    /// The region.
    pub region: String,
    /// The under-file-system path.
    pub ufs_path: String,
    /// The namespace id.
    pub ns_id: String,
    /// Present in the files but, as in veTurboIO, not used.
    pub name_node_endpoint: String,
}

#[derive(serde::Deserialize)]
struct MetaInfo {
    cache_policies: BTreeMap<String, CachePolicy>,
}

/// One group's settings: veTurboIO's `SfcsConfiguration`, field for field.
#[derive(Clone, PartialEq, Eq)]
pub struct SfcsConfiguration {
    /// `SFCS_FSNAME`.
    pub fsname: String,
    /// `SFCS_REGION`.
    pub region: String,
    /// `SFCS_UFS_PATH`.
    pub ufs_path: String,
    /// `SFCS_NS_ID`.
    pub ns_id: String,
    /// `SFCS_ACCESS_KEY`.
    pub access_key: String,
    /// `SFCS_SECRET_KEY`.
    pub secret_key: Secret,
    /// `SFCS_NETWORK_SEGMENT`.
    pub network_segment: String,
    /// `SFCS_MULTI_NIC_WHITELIST`.
    pub multi_nic_whitelist: String,
    /// `SFCS_NAMENODE_ENDPOINT_ADDRESS`.
    pub namenode_endpoint_address: String,
    /// `SFCS_AUTHENTICATION_SERVICE_NAME`.
    pub authentication_service_name: String,
    /// `SFCS_BLOCK_SIZE`.
    pub block_size: String,
    /// `SFCS_TASK_ID` (default `sfcs`).
    pub task_id: String,
    /// `SFCS_ENABLE_DNS` (default `false`).
    pub enable_dns: String,
    /// `SFCS_LOG_SEVERITY` (default `INFO`).
    pub log_severity: String,
    /// `SFCS_SYNC_INTERVAL` (default `-1`).
    pub sync_interval: String,
}

impl Default for SfcsConfiguration {
    fn default() -> Self {
        SfcsConfiguration {
            fsname: String::new(),
            region: String::new(),
            ufs_path: String::new(),
            ns_id: String::new(),
            access_key: String::new(),
            secret_key: Secret::default(),
            network_segment: String::new(),
            multi_nic_whitelist: String::new(),
            namenode_endpoint_address: String::new(),
            authentication_service_name: String::new(),
            block_size: String::new(),
            task_id: "sfcs".into(),
            enable_dns: "false".into(),
            log_severity: "INFO".into(),
            sync_interval: "-1".into(),
        }
    }
}

impl fmt::Debug for SfcsConfiguration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SfcsConfiguration")
            .field("fsname", &self.fsname)
            .field("region", &self.region)
            .field("ufs_path", &self.ufs_path)
            .field("ns_id", &self.ns_id)
            .field("access_key", &self.access_key)
            .field("secret_key", &self.secret_key)
            .field("network_segment", &self.network_segment)
            .field("multi_nic_whitelist", &self.multi_nic_whitelist)
            .field("namenode_endpoint_address", &self.namenode_endpoint_address)
            .field("authentication_service_name", &self.authentication_service_name)
            .field("block_size", &self.block_size)
            .field("task_id", &self.task_id)
            .field("enable_dns", &self.enable_dns)
            .field("log_severity", &self.log_severity)
            .field("sync_interval", &self.sync_interval)
            .finish()
    }
}

/// The `SFCS_*` variables read for a field, in veTurboIO's field order.
const FIELDS: [&str; 15] = [
    "FSNAME",
    "REGION",
    "UFS_PATH",
    "NS_ID",
    "ACCESS_KEY",
    "SECRET_KEY",
    "NETWORK_SEGMENT",
    "MULTI_NIC_WHITELIST",
    "NAMENODE_ENDPOINT_ADDRESS",
    "AUTHENTICATION_SERVICE_NAME",
    "BLOCK_SIZE",
    "TASK_ID",
    "ENABLE_DNS",
    "LOG_SEVERITY",
    "SYNC_INTERVAL",
];

/// Variables that may hold a JSON object `{group: value}` instead of a plain value.
const JSON_FIELDS: [&str; 3] = ["FSNAME", "NS_ID", "UFS_PATH"];

impl SfcsConfiguration {
    fn field_mut(&mut self, name: &str) -> Option<&mut String> {
        Some(match name {
            "FSNAME" => &mut self.fsname,
            "REGION" => &mut self.region,
            "UFS_PATH" => &mut self.ufs_path,
            "NS_ID" => &mut self.ns_id,
            "ACCESS_KEY" => &mut self.access_key,
            "NETWORK_SEGMENT" => &mut self.network_segment,
            "MULTI_NIC_WHITELIST" => &mut self.multi_nic_whitelist,
            "NAMENODE_ENDPOINT_ADDRESS" => &mut self.namenode_endpoint_address,
            "AUTHENTICATION_SERVICE_NAME" => &mut self.authentication_service_name,
            "BLOCK_SIZE" => &mut self.block_size,
            "TASK_ID" => &mut self.task_id,
            "ENABLE_DNS" => &mut self.enable_dns,
            "LOG_SEVERITY" => &mut self.log_severity,
            "SYNC_INTERVAL" => &mut self.sync_interval,
            _ => return None,
        })
    }

    /// veTurboIO's `override(from_env(group), base)`: every `SFCS_*` variable that is set
    /// (and differs from the field's default) replaces the base's value. `SFCS_FSNAME`,
    /// `SFCS_NS_ID` and `SFCS_UFS_PATH` may be JSON objects keyed by group.
    pub fn with_env_overrides(mut self, group: &str, vars: &Vars) -> SfcsConfiguration {
        let defaults = SfcsConfiguration::default();
        for name in FIELDS {
            let Some(raw) = vars(&format!("SFCS_{name}")) else { continue };
            let value = if JSON_FIELDS.contains(&name) { json_field(&raw, group) } else { Some(raw) };
            let Some(value) = value else { continue };
            if name == "SECRET_KEY" {
                if !value.is_empty() {
                    self.secret_key = Secret::new(value);
                }
                continue;
            }
            let mut d = defaults.clone();
            let default = d.field_mut(name).map(|s| s.clone()).unwrap_or_default();
            if value != default {
                if let Some(f) = self.field_mut(name) {
                    *f = value;
                }
            }
        }
        self
    }

    /// veTurboIO's `validate(use_datapipe)`, with its messages and in its order: the network
    /// setting, the required fields, then (without the datapipe) credentials and the name node.
    pub fn validate(&self, use_datapipe: bool) -> Result<(), ConfigError> {
        if self.multi_nic_whitelist.is_empty() || self.network_segment.is_empty() {
            return Err(ConfigError::Network("Network setting is not valid".into()));
        }
        for (name, value) in [
            ("fsname", &self.fsname),
            ("region", &self.region),
            ("ufs_path", &self.ufs_path),
            ("ns_id", &self.ns_id),
            ("network_segment", &self.network_segment),
            ("multi_nic_whitelist", &self.multi_nic_whitelist),
            ("authentication_service_name", &self.authentication_service_name),
        ] {
            if value.is_empty() {
                return Err(ConfigError::Required(name));
            }
        }
        if !use_datapipe {
            if self.access_key.is_empty() || self.secret_key.is_empty() {
                return Err(ConfigError::Credential("Credential is not valid".into()));
            }
            if !self.enable_dns.eq_ignore_ascii_case("true") && self.namenode_endpoint_address.is_empty() {
                return Err(ConfigError::Network("name node endpoint should be set setting is not valid".into()));
            }
        }
        Ok(())
    }

    /// veTurboIO's `to_property()`: the properties in its order, empty values dropped.
    pub fn to_properties(&self) -> Properties {
        let dns = if self.enable_dns.eq_ignore_ascii_case("true") { "true" } else { "false" };
        let mut p = Properties::default();
        p.set("cfs.filesystem.fs-mode", "ACC");
        p.set("cfs.filesystem.resolve.addr.by.dns", dns);
        p.set("cfs.metrics.emitters", "metric_server;local_prometheus");
        p.set("cfs.client.metadata-cache.enable", "false");
        p.set("rpc.client.channel.pool.size", "32");
        p.set("dfs.default.replica", "2");
        p.set("cfs.client.multi-nic.enabled", "true");
        p.set("fs.datanode.router.ignore-main-nic", "true");
        p.set("cfs.datanode.router.shuffle", "true");
        p.set("dfs.default.uri", &format!("cfs://{}.sfcs-{}.ivolces.com", self.fsname, self.region));
        p.set("dfs.authentication.service.name", &self.authentication_service_name);
        p.set("cfs.filesystem.ns-id", &self.ns_id);
        p.set("cfs.filesystem.ufs-path", &self.ufs_path);
        p.set("cfs.metrics.server.host", &format!("metricserver-{}.cfs.ivolces.com", self.region));
        p.set("cfs.client.multi-nic.whitelist", &self.multi_nic_whitelist);
        p.set("cfs.client.network.segment", &self.network_segment);
        p.set("dfs.client.log.severity", &self.log_severity);
        p.set("cfs.filesystem.task-id", &self.task_id);
        p.set("cfs.filesystem.sync-interval", &self.sync_interval);
        p.set("cfs.access.key", &self.access_key);
        p.set_secret("cfs.secret.key", self.secret_key.expose());
        p.set(&format!("cfs.namenode.endpoint.address.{}", self.fsname), &self.namenode_endpoint_address);
        p.set("dfs.default.blocksize", &self.block_size);
        p.trim();
        p
    }
}

/// `json.loads(raw)[group]` when `raw` is a JSON object, else `raw` itself. An object without
/// the group gives `None` (veTurboIO would use the JSON text itself as the value).
fn json_field(raw: &str, group: &str) -> Option<String> {
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(serde_json::Value::Object(map)) => match map.get(group) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(other) => Some(other.to_string()),
            None => None,
        },
        _ => Some(raw.to_string()),
    }
}

/// Why a group's configuration is unusable: veTurboIO's exception and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// veTurboIO's `NetworkError`.
    Network(String),
    /// veTurboIO's `RuntimeError('<field> is required')`.
    Required(&'static str),
    /// veTurboIO's `CredentialError`.
    Credential(String),
    /// A configuration source cannot be read or parsed.
    Source(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Network(m) => write!(f, "NetworkError: {m}"),
            ConfigError::Required(name) => write!(
                f,
                "RuntimeError: {name} is required (set SFCS_{} or a cache policy in SFCS_METAINFO_PATH)",
                name.to_ascii_uppercase()
            ),
            ConfigError::Credential(m) => write!(f, "CredentialError: {m}"),
            ConfigError::Source(m) => f.write_str(m),
        }
    }
}

/// Ordered `name = value` properties; values of secret properties are zeroized on drop and
/// never printed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Properties(Vec<(String, Zeroizing<String>)>);

/// Properties whose values are secrets.
const SECRET_PROPERTIES: [&str; 2] = ["cfs.secret.key", "cfs.security.token"];

impl Properties {
    /// Sets `name` (keeping its place if present, appending otherwise, like a Python dict).
    pub fn set(&mut self, name: &str, value: &str) {
        match self.0.iter_mut().find(|(k, _)| k == name) {
            Some((_, v)) => *v = Zeroizing::new(value.to_string()),
            None => self.0.push((name.to_string(), Zeroizing::new(value.to_string()))),
        }
    }

    fn set_secret(&mut self, name: &str, value: &str) {
        self.set(name, value)
    }

    /// Drops empty values.
    pub fn trim(&mut self) {
        self.0.retain(|(_, v)| !v.is_empty());
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    /// The XML libcloudfs reads, byte for byte what veTurboIO's `generate_sfcs_conf_xml`
    /// (Python's minidom, `writexml(indent='\t', addindent='\t', newl='\n', encoding='utf-8')`)
    /// writes. Zeroized on drop: it holds the secrets.
    pub fn to_xml(&self) -> Zeroizing<String> {
        let mut out = Zeroizing::new(String::with_capacity(256 + 96 * self.0.len()));
        out.push_str("<?xml version=\"1.0\" encoding=\"utf-8\"?>\n");
        out.push_str("\t<?xml-stylesheet type=\"text/xsl\" href=\"configuration.xsl\"?>\n");
        out.push_str("\t<configuration>\n");
        for (k, v) in &self.0 {
            out.push_str("\t\t<property>\n\t\t\t<name>");
            escape_into(&mut out, k);
            out.push_str("</name>\n\t\t\t<value>");
            escape_into(&mut out, v);
            out.push_str("</value>\n\t\t</property>\n");
        }
        out.push_str("\t</configuration>\n");
        out
    }
}

impl fmt::Debug for Properties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (k, v) in &self.0 {
            if SECRET_PROPERTIES.contains(&k.as_str()) {
                m.entry(k, &"<redacted>");
            } else {
                m.entry(k, &v.as_str());
            }
        }
        m.finish()
    }
}

/// minidom's text escaping (Python 3.11): `&`, `<`, `"` and `>`.
fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '"' => out.push_str("&quot;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
}

/// Everything the configuration is built from, read once per operation.
#[derive(Clone)]
pub struct Sources {
    /// Cache policies by key (a path prefix).
    pub policies: BTreeMap<String, CachePolicy>,
    /// The policies' file, for messages.
    pub metainfo_path: PathBuf,
    /// `MLP_ACCESS_KEY` from the credential directory.
    pub file_access_key: String,
    /// `MLP_SECRET_KEY` from the credential directory.
    pub file_secret_key: Secret,
    /// The variables.
    pub vars: Vars,
}

impl fmt::Debug for Sources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sources")
            .field("policies", &self.policies)
            .field("metainfo_path", &self.metainfo_path)
            .field("file_access_key", &self.file_access_key)
            .field("file_secret_key", &self.file_secret_key)
            .finish_non_exhaustive()
    }
}

impl Sources {
    /// Reads the policy file and the credential files named by `vars` (or veTurboIO's
    /// defaults). A policy file that exists but cannot be parsed is an error (veTurboIO logs a
    /// warning and ignores every policy); a missing one means no policies.
    pub fn read(vars: Vars) -> Result<Sources, ConfigError> {
        let metainfo_path = PathBuf::from(vars("SFCS_METAINFO_PATH").unwrap_or_else(|| DEFAULT_METAINFO_PATH.into()));
        let policies = match std::fs::read(&metainfo_path) {
            Ok(bytes) => {
                serde_json::from_slice::<MetaInfo>(&bytes)
                    .map_err(|e| {
                        ConfigError::Source(format!(
                            "SFCS_METAINFO_PATH {}: not a valid cache-policy file: {e}",
                            metainfo_path.display()
                        ))
                    })?
                    .cache_policies
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                return Err(ConfigError::Source(format!(
                    "SFCS_METAINFO_PATH {}: cannot be read: {e}",
                    metainfo_path.display()
                )))
            }
        };
        let cred_dir = PathBuf::from(vars("CREDENTIAL_PATH").unwrap_or_else(|| DEFAULT_CREDENTIAL_PATH.into()));
        let (ak_path, sk_path) = (cred_dir.join("MLP_ACCESS_KEY"), cred_dir.join("MLP_SECRET_KEY"));
        let (mut file_access_key, mut file_secret_key) = (String::new(), Secret::default());
        if ak_path.exists() && sk_path.exists() {
            let read = |p: &Path| {
                std::fs::read_to_string(p)
                    .map(Zeroizing::new)
                    .map_err(|e| ConfigError::Source(format!("CREDENTIAL_PATH: {} cannot be read: {e}", p.display())))
            };
            file_access_key = read(&ak_path)?.trim().to_string();
            file_secret_key = Secret::new(read(&sk_path)?.trim());
        }
        Ok(Sources { policies, metainfo_path, file_access_key, file_secret_key, vars })
    }

    /// veTurboIO's `sfcs_conf_group`: the longest policy key that is a prefix of `path`, else
    /// the first component of the (absolute) path.
    pub fn group_of(&self, path: &str) -> String {
        let longest = self.policies.keys().filter(|k| path.starts_with(k.as_str())).max_by_key(|k| k.len());
        match longest {
            Some(k) if !k.is_empty() => k.clone(),
            _ => path.trim_start_matches('/').split('/').next().unwrap_or("").to_string(),
        }
    }

    /// veTurboIO's `path_mapper`: with the group's policy's `cache_prefix`, the path minus the
    /// mount path, joined to the prefix; otherwise the path unchanged.
    pub fn map_path(&self, path: &str, group: &str) -> String {
        match self.policies.get(group) {
            Some(p) if !p.cache_prefix.is_empty() => {
                let trimmed = path.strip_prefix(p.mount_path.as_str()).unwrap_or(path);
                let trimmed = trimmed.strip_prefix('/').unwrap_or(trimmed);
                py_join(&p.cache_prefix, trimmed)
            }
            _ => path.to_string(),
        }
    }

    /// True when veTurboIO would not use the datapipe: `SFCS_ACCESS_KEY`, `SFCS_SECRET_KEY` and
    /// `SFCS_NAMENODE_ENDPOINT_ADDRESS` are all set, or the credential files gave a key pair.
    pub fn datapipe_needless(&self) -> bool {
        let v = &self.vars;
        (v("SFCS_ACCESS_KEY").is_some()
            && v("SFCS_SECRET_KEY").is_some()
            && v("SFCS_NAMENODE_ENDPOINT_ADDRESS").is_some())
            || (!self.file_access_key.is_empty() && !self.file_secret_key.is_empty())
    }

    /// The group's configuration before validation: its policy (with the credential files and
    /// the RDMA network) or the defaults, then the `SFCS_*` overrides.
    pub fn configuration(&self, group: &str) -> SfcsConfiguration {
        let base = match self.policies.get(group) {
            Some(p) => {
                let nic = (self.vars)("MLP_RDMA_NIC_NAMES").unwrap_or_else(|| DEFAULT_NIC.into());
                let segment = (self.vars)("MLP_RDMA_NETWORK_SEGMENT").unwrap_or_else(|| segment_of(&nic));
                SfcsConfiguration {
                    fsname: p.sfcs_fs_name.clone(),
                    region: p.region.clone(),
                    ufs_path: p.ufs_path.clone(),
                    ns_id: p.ns_id.clone(),
                    access_key: self.file_access_key.clone(),
                    secret_key: self.file_secret_key.clone(),
                    network_segment: segment,
                    multi_nic_whitelist: nic,
                    enable_dns: p.enable_dns.clone(),
                    authentication_service_name: p.authentication_service_name.clone(),
                    ..SfcsConfiguration::default()
                }
            }
            None => SfcsConfiguration::default(),
        };
        base.with_env_overrides(group, &self.vars)
    }

    /// The datapipe settings (`DATAPIPE_SOCKET_PATH`).
    pub fn datapipe(&self) -> DatapipeConfig {
        let v = self.vars.clone();
        DatapipeConfig::from_vars(move |k| v(k))
    }

    /// `SFCS_CONCAT_DIR` for the group (a plain path or a JSON object keyed by group).
    pub fn concat_dir(&self, group: &str) -> Option<String> {
        (self.vars)("SFCS_CONCAT_DIR").and_then(|raw| json_field(&raw, group)).filter(|d| !d.is_empty())
    }
}

/// Python's `os.path.join(a, b)` for two parts.
fn py_join(a: &str, b: &str) -> String {
    if b.starts_with('/') || a.is_empty() {
        b.to_string()
    } else if a.ends_with('/') {
        format!("{a}{b}")
    } else {
        format!("{a}/{b}")
    }
}

/// The IPv4 network of `nic` (`a.b.c.d/len`), veTurboIO's default network segment; empty when
/// the interface has no IPv4 address (veTurboIO logs a warning and leaves it empty).
fn segment_of(nic: &str) -> String {
    let Ok(ifaces) = if_addrs::get_if_addrs() else { return String::new() };
    for i in ifaces {
        if i.name != nic {
            continue;
        }
        if let if_addrs::IfAddr::V4(v4) = i.addr {
            let mask = u32::from(v4.netmask);
            let net = std::net::Ipv4Addr::from(u32::from(v4.ip) & mask);
            return format!("{net}/{}", mask.count_ones());
        }
    }
    String::new()
}

/// veTurboIO's `generate_sfcs_conf_path` file name: the group without its leading `/`, with
/// `/` replaced by `#`, plus `.xml`.
pub fn conf_file_name(group: &str) -> String {
    let g = group.strip_prefix('/').unwrap_or(group);
    format!("{}.xml", g.replace('/', "#"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> Vars {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Arc::new(move |k: &str| m.get(k).cloned().filter(|v| !v.is_empty()))
    }

    fn sources(policies: &[(&str, CachePolicy)], v: Vars) -> Sources {
        Sources {
            policies: policies.iter().map(|(k, p)| (k.to_string(), p.clone())).collect(),
            metainfo_path: PathBuf::from("/none"),
            file_access_key: String::new(),
            file_secret_key: Secret::default(),
            vars: v,
        }
    }

    #[test]
    fn groups_and_path_mapping_follow_veturboio() {
        let p = |mount: &str, prefix: &str| CachePolicy {
            mount_path: mount.into(),
            cache_prefix: prefix.into(),
            ..Default::default()
        };
        let s = sources(
            &[
                ("/sfcs/required", p("/sfcs/required", "/sft_demo")),
                ("/sfcs/testmodel", p("/sfcs/testmodel", "/")),
                ("/sfcs", p("/sfcs", "")),
            ],
            vars(&[]),
        );
        assert_eq!(s.group_of("/sfcs/required/ckpt/x"), "/sfcs/required");
        assert_eq!(s.map_path("/sfcs/required/ckpt/x", "/sfcs/required"), "/sft_demo/ckpt/x");
        assert_eq!(s.map_path("/sfcs/testmodel/ckpt/x", "/sfcs/testmodel"), "/ckpt/x");
        assert_eq!(s.group_of("/sfcs/other/x"), "/sfcs");
        assert_eq!(s.map_path("/sfcs/other/x", "/sfcs"), "/sfcs/other/x");
        assert_eq!(s.group_of("/data/x"), "data");
        assert_eq!(s.group_of("/model.safetensors"), "model.safetensors");
        assert_eq!(conf_file_name("/sfcs/required"), "sfcs#required.xml");
        assert_eq!(conf_file_name("data"), "data.xml");
    }

    #[test]
    fn env_overrides_and_json_values() {
        let s = sources(
            &[],
            vars(&[
                ("SFCS_FSNAME", r#"{"data": "fs-data", "other": "fs-other"}"#),
                ("SFCS_NS_ID", "ns-plain"),
                ("SFCS_UFS_PATH", r#"{"other": "tos://x"}"#),
                ("SFCS_TASK_ID", "sfcs"),
                ("SFCS_LOG_SEVERITY", "DEBUG"),
            ]),
        );
        let c = s.configuration("data");
        assert_eq!(c.fsname, "fs-data");
        assert_eq!(c.ns_id, "ns-plain");
        assert_eq!(c.ufs_path, "");
        assert_eq!(c.task_id, "sfcs");
        assert_eq!(c.log_severity, "DEBUG");
    }

    #[test]
    fn validation_messages_and_order() {
        let full = SfcsConfiguration {
            fsname: "fs".into(),
            region: "cn-beijing".into(),
            ufs_path: "tos://b/p".into(),
            ns_id: "ns".into(),
            access_key: "AK".into(),
            secret_key: Secret::new("SK"),
            network_segment: "10.0.0.0/8".into(),
            multi_nic_whitelist: "eth0".into(),
            namenode_endpoint_address: "10.0.0.1".into(),
            authentication_service_name: "auth".into(),
            ..Default::default()
        };
        full.validate(false).unwrap();
        let err = |f: &dyn Fn(&mut SfcsConfiguration), dp: bool| {
            let mut c = full.clone();
            f(&mut c);
            c.validate(dp).unwrap_err().to_string()
        };
        assert_eq!(err(&|c| c.network_segment.clear(), false), "NetworkError: Network setting is not valid");
        assert_eq!(err(&|c| c.multi_nic_whitelist.clear(), true), "NetworkError: Network setting is not valid");
        assert!(err(&|c| c.fsname.clear(), false).starts_with("RuntimeError: fsname is required"));
        assert!(err(&|c| c.region.clear(), true).starts_with("RuntimeError: region is required"));
        assert!(err(&|c| c.ufs_path.clear(), true).starts_with("RuntimeError: ufs_path is required"));
        assert!(err(&|c| c.ns_id.clear(), true).starts_with("RuntimeError: ns_id is required"));
        assert!(err(&|c| c.authentication_service_name.clear(), true)
            .starts_with("RuntimeError: authentication_service_name is required"));
        assert_eq!(err(&|c| c.access_key.clear(), false), "CredentialError: Credential is not valid");
        assert_eq!(err(&|c| c.secret_key = Secret::default(), false), "CredentialError: Credential is not valid");
        assert_eq!(
            err(&|c| c.namenode_endpoint_address.clear(), false),
            "NetworkError: name node endpoint should be set setting is not valid"
        );
        // With the datapipe, credentials and the name node come from sfcs-sts.
        let mut c = full.clone();
        c.access_key.clear();
        c.namenode_endpoint_address.clear();
        c.validate(true).unwrap();
        // DNS resolution makes the name node optional.
        c.enable_dns = "True".into();
        c.access_key = "AK".into();
        c.validate(false).unwrap();
        assert!(!format!("{full:?}").contains("\"SK\""));
    }

    #[test]
    fn xml_escapes_like_minidom() {
        let mut p = Properties::default();
        p.set("a.b", "x&y<z>\"q'");
        p.set("c", "v");
        assert_eq!(
            p.to_xml().as_str(),
            "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n\t<?xml-stylesheet type=\"text/xsl\" href=\"configuration.xsl\"?>\n\t<configuration>\n\t\t<property>\n\t\t\t<name>a.b</name>\n\t\t\t<value>x&amp;y&lt;z&gt;&quot;q'</value>\n\t\t</property>\n\t\t<property>\n\t\t\t<name>c</name>\n\t\t\t<value>v</value>\n\t\t</property>\n\t</configuration>\n"
        );
        p.set("cfs.secret.key", "hidden-value");
        assert!(!format!("{p:?}").contains("hidden-value"));
    }
}
