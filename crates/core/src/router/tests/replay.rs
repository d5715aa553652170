//! Determinism: the same inputs give the same decisions and state, and state survives a
//! serialization round trip.

use super::*;

/// A mixed input sequence exercising every kind of input.
fn scripted_inputs() -> Vec<Stamped> {
    let mut inputs = Vec::new();
    let mut seq = 0;
    let mut push = |at_ms: u64, input: Input| {
        seq += 1;
        inputs.push(Stamped { seq, at_ms, input });
    };
    let workers = ["w0", "w1", "w2", "w3", "w4"];
    for step in 0..400u64 {
        let t = 1_000 + step * 137;
        let w = workers[(step * 7 % 5) as usize];
        match step % 6 {
            0 => push(
                t,
                Input::Load(LoadSample {
                    worker: id(w),
                    kv_usage: ((step * 37) % 100) as f64 / 100.0,
                    running: (step % 9) as u32,
                    waiting: (step % 4) as u32,
                    max_running: Some(8),
                    model: None,
                    dp_rank: 0,
                }),
            ),
            1 | 2 => {
                let locals: Vec<u64> = (0..(step % 7 + 1)).map(|i| (step / 12) * 10 + i).collect();
                push(t, Input::Route(Fleet::request(&locals)));
            }
            3 => {
                let locals: Vec<u64> = (0..(step % 5 + 1)).map(|i| (step / 18) * 10 + i).collect();
                let keys = chain_locals(locals.iter().copied());
                push(
                    t,
                    Input::KvEvents(KvEventBatch::stored(
                        id(w),
                        None,
                        keys.iter()
                            .zip(&locals)
                            .map(|(&k, &local)| StoredBlock {
                                engine_hash: engine(k),
                                local,
                            })
                            .collect(),
                        BLOCK,
                    )),
                );
            }
            4 => push(
                t,
                Input::Release {
                    reservation: step.saturating_sub(5),
                    phase: None,
                },
            ),
            _ => push(t, Input::Tick),
        }
    }
    inputs
}

#[test]
fn applying_the_same_inputs_twice_yields_the_same_decisions_and_state() {
    let run = || {
        let mut router = Router::new(RouterConfig {
            block_size: BLOCK,
            ..RouterConfig::default()
        });
        let outputs: Vec<Output> = scripted_inputs().iter().map(|s| router.apply(s)).collect();
        let state = rmp_serde::to_vec(router.state()).unwrap();
        (outputs, state, router.ownerships())
    };
    let (out_a, state_a, own_a) = run();
    let (out_b, state_b, own_b) = run();
    let decisions = out_a
        .iter()
        .filter(|o| matches!(o, Output::Routed(_)))
        .count();
    assert!(decisions > 50, "the script makes decisions ({decisions})");
    assert_eq!(out_a, out_b, "same inputs, same outputs");
    assert_eq!(own_a, own_b, "same inputs, same ownership");
    assert_eq!(state_a, state_b, "same inputs, byte-identical state");
}

#[test]
fn state_survives_a_serialization_round_trip() {
    let inputs = scripted_inputs();
    let (head, tail) = inputs.split_at(200);
    let config = RouterConfig {
        block_size: BLOCK,
        ..RouterConfig::default()
    };
    let mut straight = Router::new(config.clone());
    let mut restored = Router::new(config.clone());
    for s in head {
        straight.apply(s);
        restored.apply(s);
    }
    let bytes = rmp_serde::to_vec(restored.state()).unwrap();
    let mut restored = Router::from_state(config, rmp_serde::from_slice(&bytes).unwrap());
    for s in tail {
        assert_eq!(
            straight.apply(s),
            restored.apply(s),
            "input {} after a snapshot",
            s.seq
        );
    }
}
