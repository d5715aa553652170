//! The route rows' tests: depths per tier and the ranks a walk lists, a row's model class, draws
//! over the pools, and rows that go stale with their route.

use super::*;

/// One route's walk: `owners` of each key in turn, on the device tier.
fn walk(scratch: &mut RouteScratch, keys: &[&[Slot]]) {
    scratch.prepare(8);
    for (i, owners) in keys.iter().enumerate() {
        if !scratch.extend::<DEVICE>(i..i + 1, owners.iter().copied()) {
            break;
        }
    }
}

#[test]
fn only_ranks_matching_a_first_key_are_listed_and_each_tier_counts_on_its_own() {
    let mut scratch = RouteScratch::default();
    scratch.prepare(8);
    let device: [&[Slot]; 3] = [&[1], &[1, 3], &[1, 1]];
    for (i, owners) in device.iter().enumerate() {
        assert!(scratch.extend::<DEVICE>(i..i + 1, owners.iter().copied()));
    }
    let host: [&[Slot]; 2] = [&[2, 1], &[2]];
    for (i, owners) in host.iter().enumerate() {
        assert!(scratch.extend::<HOST>(i..i + 1, owners.iter().copied()));
    }
    assert!(
        !scratch.extend::<DISK>(0..1, [].into_iter()),
        "a key nobody holds ends the walk"
    );
    assert_eq!(
        scratch.depths(1),
        (3, 1, 0),
        "rank 1: three device keys (one listed twice), the first host key only"
    );
    assert_eq!(
        scratch.depths(2),
        (0, 2, 0),
        "rank 2 is met on the host tier"
    );
    assert_eq!(
        scratch.depths(3),
        (0, 0, 0),
        "rank 3 holds the second key without the first: no match"
    );
    assert_eq!(
        scratch.touched(),
        &[1, 2],
        "each rank with a match is listed once; rank 3 never is"
    );
    assert_eq!(scratch.deepest[DEVICE], 3, "the device walk reached key 3");
    assert_eq!(scratch.deepest[HOST], 2, "the host walk reached key 2");
}

#[test]
fn a_run_of_keys_extends_only_ranks_that_matched_every_key_before_it() {
    let mut scratch = RouteScratch::default();
    scratch.prepare(8);
    assert!(scratch.extend::<DEVICE>(0..1, [1, 2].into_iter()));
    assert!(scratch.extend::<DEVICE>(1..2, [1].into_iter()));
    // Keys 2 to 4 held by ranks 1, 2 and 3: only rank 1 holds every key before them.
    assert!(scratch.extend::<DEVICE>(2..5, [1, 2, 3].into_iter()));
    assert_eq!(scratch.depths(1).0, 5, "rank 1 matches through the run");
    assert_eq!(
        scratch.depths(2).0,
        1,
        "rank 2 missed key 1: the run adds nothing"
    );
    assert_eq!(scratch.depths(3).0, 0, "rank 3 never held the first key");
    assert_eq!(scratch.deepest[DEVICE], 5, "the walk reached the run's end");
    assert!(
        !scratch.extend::<DEVICE>(5..7, [2, 3].into_iter()),
        "a run nobody continues ends the walk"
    );
}

/// An active worker entry of model `m` with `reserved_work` 7, as the worker table makes it.
fn worker() -> Worker {
    let mut workers = Workers::default();
    let id = crate::input::WorkerId::new("w").expect("a worker id");
    let (slot, _) = workers.touch(&id, 0, 0);
    let w = workers.get_mut(slot).expect("just joined");
    w.model = Some("m".to_owned());
    w.reserved_work = 7;
    w.clone()
}

#[test]
fn a_row_answers_which_model_its_rank_serves_unless_the_class_is_past_it() {
    let worker = worker();
    let mut row = RankRow::default();
    for (class, request, serves) in [
        (2, Classes(NO_MODEL, Some(2)), Some(true)),
        (2, Classes(NO_MODEL, Some(3)), Some(false)),
        (2, Classes(NO_MODEL, None), Some(false)),
        (NO_MODEL, Classes(NO_MODEL, Some(3)), Some(true)),
        (2, Classes(ALL, None), Some(true)),
        (65_535, Classes(NO_MODEL, Some(2)), None),
        (70_000, Classes(NO_MODEL, Some(70_000)), None),
        (70_000, Classes(ALL, None), Some(true)),
    ] {
        row.refresh(Some(&worker), 0, class, None);
        assert_eq!(
            row.serves(request),
            serves,
            "class {class} for {request:?}: a class the row cannot hold is left to the entry"
        );
    }
    assert!(row.is_live() && row.is_active() && row.pressure().is_none());
    row.refresh(None, 0, 0, Some(0.5));
    assert!(!row.is_live(), "a free slot's row holds no rank");
}

#[test]
fn a_draw_finds_the_kth_member_in_slot_order_up_to_the_last_slot() {
    let cap = 16;
    let mut pools = Pools {
        cap,
        trees: vec![Default::default(); 3],
        members: vec![Member::default(); cap],
        ..Pools::default()
    };
    // Slots 0 and 15 (the first and last the trees cover) without a model, 4 and 9 of
    // model class 2, 6 of another class that neither request below may use but the
    // whole fleet.
    let members = [(0, NO_MODEL), (4, 2), (6, 3), (9, 2), (15, NO_MODEL)];
    pools.trees.push(Default::default());
    for (slot, class) in members {
        let member = Member {
            pools: bit(Pool::Candidates),
            class,
        };
        pools.count(slot, member, true);
        pools.members[slot as usize] = member;
    }
    let drawn = |classes: Classes| -> Vec<Slot> {
        (0..pools.total(Pool::Candidates, classes))
            .map(|k| pools.select(Pool::Candidates, classes, k))
            .collect()
    };
    assert_eq!(
        drawn(Classes(ALL, None)),
        [0, 4, 6, 9, 15],
        "every member of the fleet, in slot order"
    );
    assert_eq!(
        drawn(Classes(NO_MODEL, Some(2))),
        [0, 4, 9, 15],
        "a model's request draws from two trees summed: no model, and its own"
    );
    assert_eq!(
        pools.total(Pool::Cool, Classes(ALL, None)),
        0,
        "a member counts only in its own pools"
    );
}

#[test]
fn a_finished_routes_depths_read_as_zero_in_later_routes_also_past_the_counters_wrap() {
    let mut scratch = RouteScratch::default();
    walk(&mut scratch, &[&[1, 2], &[1]]);
    assert_eq!(scratch.depths(1), (2, 0, 0), "rank 1 matched both keys");
    assert_eq!(scratch.touched(), &[1, 2]);
    scratch.finish(RouteBuffers::default());
    // As if 2^32 - 3 routes that never met rank 1 went by: the counter is about to come
    // back to the number rank 1's row carries.
    scratch.route = u32::MAX;
    scratch.rows[1].refresh(Some(&worker()), 5, NO_MODEL, Some(0.25));
    for _ in 0..3 {
        walk(&mut scratch, &[&[2]]);
        assert_eq!(
            scratch.depths(1),
            (0, 0, 0),
            "a depth of an earlier route never leaks into a later one"
        );
        assert_eq!(
            scratch.depths(2),
            (1, 0, 0),
            "rank 2 starts over at the first key"
        );
        assert_eq!(
            scratch.touched(),
            &[2],
            "only this route's matches are listed"
        );
        scratch.finish(RouteBuffers::default());
    }
    let row = scratch.rows[1];
    assert!(
        row.is_live() && (row.id_order, row.reserved_work, row.pressure()) == (5, 7, Some(0.25)),
        "clearing the depths at the wrap keeps the rows' copies of the worker entries"
    );
}
