//! The SFCS backend over the fake libcloudfs: the storage conformance suite, every injected
//! fault, the configuration and its XML, and the datapipe STS refresh.

mod support;

use support::*;
use turboio_storage::conformance::{self, Capabilities};
use turboio_storage::IoOptions;

#[test]
fn conformance_suite_over_the_fake_library() {
    let c = Cluster::new();
    let s = c.storage();
    for threads in [4, 1] {
        let dir = c.scratch(&format!("conformance-{threads}"));
        let opts = IoOptions { threads, ..Default::default() };
        conformance::run_all(&s, &dir, Capabilities { local_dir: true }, &opts);
    }
}
