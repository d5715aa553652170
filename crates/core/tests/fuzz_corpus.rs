//! The fuzz corpus, replayed on stable: every input the fuzzers kept (`fuzz/corpus/<target>/`),
//! and the KV-event fixtures they start from, goes through the same entry point as the fuzz
//! target, so a decoder bug found once stays fixed.

use std::path::{Path, PathBuf};

use kvrouted_core::wire::fuzz::TARGETS;

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("readable corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_corpus_input_passes_its_fuzz_target() {
    let mut replayed = 0;
    for (name, target) in TARGETS {
        let corpus = files_in(&repo_path(&format!("fuzz/corpus/{name}")));
        assert!(
            !corpus.is_empty(),
            "fuzz/corpus/{name} holds a seed corpus for every fuzz target"
        );
        for path in corpus {
            let data = std::fs::read(&path).expect("readable corpus file");
            target(&data);
            replayed += 1;
        }
    }
    assert!(replayed >= TARGETS.len(), "the corpus was replayed");
}

#[test]
fn every_kv_event_fixture_passes_the_batch_target() {
    let fixtures: Vec<PathBuf> = files_in(&repo_path("tests/fixtures/kv_events"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "msgpack"))
        .collect();
    assert!(fixtures.len() >= 10, "the KV-event fixtures are found");
    for path in fixtures {
        kvrouted_core::wire::fuzz::kv_batch(&std::fs::read(&path).expect("readable fixture"));
    }
}
