//! The examples and block-key vectors in `schemas/`.

use super::*;

#[test]
fn schema_examples_decode_with_their_decoders() {
    let dir = manifest_path("schemas/examples");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let (mut kv, mut load_n, mut life) = (0, 0, 0);
    for path in paths {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).expect("example readable");
        let json: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
        let payload = mp(json);
        if name.starts_with("kv-batch") {
            let batch = decode(&payload).unwrap_or_else(|r| panic!("{name}: {r:?}"));
            assert!(
                !batch.events.is_empty(),
                "{name}: an example batch carries events"
            );
            kv += 1;
        } else if name.starts_with("load-sample") {
            decode_load(&payload, worker()).unwrap_or_else(|r| panic!("{name}: {r:?}"));
            load_n += 1;
        } else if name.starts_with("lifecycle") {
            decode_lifecycle(&payload, worker()).unwrap_or_else(|r| panic!("{name}: {r:?}"));
            life += 1;
        } else {
            panic!("{name}: example names start with kv-batch, load-sample or lifecycle");
        }
    }
    assert!(
        kv >= 2 && load_n >= 1 && life >= 1,
        "examples exist for every payload kind"
    );
}

#[test]
fn block_key_vectors_match_the_hashing_module() {
    let path = manifest_path("schemas/block-keys.json");
    let text = std::fs::read_to_string(&path).expect("schemas/block-keys.json");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("block-keys.json parses");
    let vectors = doc["vectors"].as_array().expect("vectors");
    assert!(
        vectors.len() >= 4,
        "the design vector plus several multi-block vectors"
    );
    let u64s = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("u64"))
            .collect()
    };
    let mut saw_design_vector = false;
    for v in vectors {
        let name = v["name"].as_str().expect("name");
        let bs = v["block_size"].as_u64().expect("block_size") as usize;
        let tokens: Vec<u32> = u64s(&v["tokens"]).into_iter().map(|t| t as u32).collect();
        let locals: Vec<u64> = tokens.chunks_exact(bs).map(local_hash).collect();
        assert_eq!(locals, u64s(&v["locals"]), "{name}: local hashes");
        assert_eq!(
            block_keys(&tokens, bs),
            u64s(&v["keys"]),
            "{name}: chained block keys"
        );
        saw_design_vector |= tokens == [1, 2, 3, 4] && locals == [14643705804678351452];
    }
    assert!(
        saw_design_vector,
        "the published block-key test vector is in the file"
    );
}
