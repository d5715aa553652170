//! The owner index: which worker holds which prompt prefix.
//!
//! Two kinds of ownership live side by side:
//!
//! - [`OwnerIndex`]: *authoritative* ownership, folded from the workers' own KV events;
//! - [`ApproxIndex`]: *approximate* ownership, the router's own recent routing records, so a
//!   trajectory's next turn finds its owner before that owner's KV events arrive.
//!
//! Both are keyed by (namespace, block key); a namespace is one (model, LoRA) pair. Ownership
//! is held per worker rank: a [`Slot`] is one (worker, data-parallel rank).
//!
//! Blocks a worker reports on a lower tier (host memory, disk) live in [`LowerTiers`], two more
//! [`OwnerIndex`]es that are never mixed with device ownership.

mod approx;
mod key_table;
mod owner_map;
mod owners;
mod slab;
mod table_memory;

pub use approx::ApproxIndex;
pub use owner_map::extend_match;
pub use owners::{IndexStats, OwnerIndex};
pub use table_memory::mapped_table_bytes;

use std::hash::{Hash, Hasher};

use rustc_hash::{FxHashMap, FxHasher};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::input::Medium;

/// Dense id of a worker rank inside the router (its slot in the worker table): one per
/// (worker, data-parallel rank).
pub type Slot = u32;

/// Dense id of a (model, LoRA) namespace.
pub type NsId = u32;

/// A namespace: each (model, LoRA name) pair keys its own blocks (docs/architecture.md, "Block
/// keys").
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Namespace {
    pub model: Option<String>,
    pub lora: Option<String>,
}

/// Interns namespaces into dense ids. Ids are never reused, so they are stable for the life of
/// the state (and across snapshots). Every namespace costs memory for the life of the state,
/// so the count is capped by the caller ([`Namespaces::intern`]'s `max`).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Namespaces {
    names: Vec<Namespace>,
    /// Hash of (model, lora) → the ids with that hash: a lookup hashes the borrowed names and
    /// builds no owned key, and costs the same with 1 namespace or `--max-models`.
    #[serde(skip)]
    ids: FxHashMap<u64, SmallVec<[NsId; 1]>>,
}

fn name_hash(model: Option<&str>, lora: Option<&str>) -> u64 {
    let mut h = FxHasher::default();
    (model, lora).hash(&mut h);
    h.finish()
}

impl Namespaces {
    /// The id of (model, lora), creating it if there are fewer than `max` namespaces. `None`
    /// when it is new and the cap is reached: the caller rejects what needed it.
    pub fn intern(&mut self, model: Option<&str>, lora: Option<&str>, max: usize) -> Option<NsId> {
        if let Some(id) = self.get(model, lora) {
            return Some(id);
        }
        if self.names.len() >= max {
            return None;
        }
        let id = self.names.len() as NsId;
        self.names.push(Namespace {
            model: model.map(str::to_owned),
            lora: lora.map(str::to_owned),
        });
        self.ids.entry(name_hash(model, lora)).or_default().push(id);
        Some(id)
    }

    /// The id of a namespace that has been seen, without creating it.
    pub fn get(&self, model: Option<&str>, lora: Option<&str>) -> Option<NsId> {
        self.ids
            .get(&name_hash(model, lora))?
            .iter()
            .copied()
            .find(|&id| {
                let ns = &self.names[id as usize];
                ns.model.as_deref() == model && ns.lora.as_deref() == lora
            })
    }

    pub fn name(&self, id: NsId) -> &Namespace {
        &self.names[id as usize]
    }

    /// Number of namespaces.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Rebuilds the lookup map after deserialization.
    pub fn rebuild(&mut self) {
        self.ids.clear();
        for (i, ns) in self.names.iter().enumerate() {
            self.ids
                .entry(name_hash(ns.model.as_deref(), ns.lora.as_deref()))
                .or_default()
                .push(i as NsId);
        }
    }
}

/// Lower-tier ownership from KV events whose `medium` is not the device: blocks a worker rank
/// keeps in host memory or on disk. Reloading them beats a prefill, so a policy may prefer
/// such a rank, but they are never device ownership.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct LowerTiers {
    pub host: OwnerIndex,
    pub disk: OwnerIndex,
}

clone_in_place!(LowerTiers { host, disk });

impl LowerTiers {
    /// The index of a lower tier; `None` for the device tier.
    pub fn tier_mut(&mut self, medium: Medium) -> Option<&mut OwnerIndex> {
        match medium {
            Medium::Gpu => None,
            Medium::Host => Some(&mut self.host),
            Medium::Disk => Some(&mut self.disk),
        }
    }

    pub fn tier(&self, medium: Medium) -> Option<&OwnerIndex> {
        match medium {
            Medium::Gpu => None,
            Medium::Host => Some(&self.host),
            Medium::Disk => Some(&self.disk),
        }
    }

    /// Drops every lower-tier block of a worker rank. Returns how many.
    pub fn clear_worker(&mut self, slot: Slot) -> usize {
        self.host.clear_worker(slot) + self.disk.clear_worker(slot)
    }

    pub fn move_namespace(&mut self, slot: Slot, from: NsId, to: NsId) {
        self.host.move_namespace(slot, from, to);
        self.disk.move_namespace(slot, from, to);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_found_by_name_and_capped_at_max() {
        let mut names = Namespaces::default();
        let max = 256;
        let name = |i: usize| {
            (
                format!("model-{}", i / 2),
                (i % 2 == 1).then(|| format!("l{i}")),
            )
        };
        for i in 0..max {
            let (m, l) = name(i);
            assert_eq!(
                names.intern(Some(&m), l.as_deref(), max),
                Some(i as NsId),
                "namespace {i} is created in order"
            );
        }
        assert_eq!(
            names.intern(Some("one-too-many"), None, max),
            None,
            "no namespace past the cap"
        );
        assert_eq!(names.get(Some("one-too-many"), None), None);
        let mut restored: Namespaces =
            rmp_serde::from_slice(&rmp_serde::to_vec(&names).unwrap()).unwrap();
        restored.rebuild();
        for table in [&mut names, &mut restored] {
            for i in 0..max {
                let (m, l) = name(i);
                assert_eq!(
                    table.get(Some(&m), l.as_deref()),
                    Some(i as NsId),
                    "namespace {i}"
                );
                assert!(
                    table.intern(Some(&m), l.as_deref(), 0).is_some(),
                    "an existing namespace is found even at the cap"
                );
            }
            assert_eq!(
                table.get(None, None),
                None,
                "the default namespace was never made"
            );
        }
    }
}
