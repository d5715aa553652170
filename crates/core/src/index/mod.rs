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

pub use approx::ApproxIndex;
pub use owners::{IndexStats, OwnerIndex};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::input::Medium;

/// Dense id of a worker rank inside the router (its slot in the worker table): one per
/// (worker, data-parallel rank).
pub type Slot = u32;

/// Dense id of a (model, LoRA) namespace.
pub type NsId = u32;

/// A namespace: each (model, LoRA name) pair keys its own blocks (docs/architecture.md, "Block keys").
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Namespace {
    pub model: Option<String>,
    pub lora: Option<String>,
}

/// Interns namespaces into dense ids. Ids are never reused, so they are stable for the life of
/// the state (and across snapshots).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Namespaces {
    names: Vec<Namespace>,
    #[serde(skip)]
    ids: FxHashMap<Namespace, NsId>,
}

impl Namespaces {
    pub fn intern(&mut self, model: Option<&str>, lora: Option<&str>) -> NsId {
        let ns = Namespace {
            model: model.map(str::to_owned),
            lora: lora.map(str::to_owned),
        };
        if let Some(&id) = self.ids.get(&ns) {
            return id;
        }
        let id = self.names.len() as NsId;
        self.names.push(ns.clone());
        self.ids.insert(ns, id);
        id
    }

    /// The id of a namespace that has been seen, without creating it.
    pub fn get(&self, model: Option<&str>, lora: Option<&str>) -> Option<NsId> {
        // Namespaces are few; a linear scan avoids building an owned key for each lookup.
        self.names
            .iter()
            .position(|ns| ns.model.as_deref() == model && ns.lora.as_deref() == lora)
            .map(|i| i as NsId)
    }

    pub fn name(&self, id: NsId) -> &Namespace {
        &self.names[id as usize]
    }

    /// Rebuilds the lookup map after deserialization.
    pub fn rebuild(&mut self) {
        self.ids = self
            .names
            .iter()
            .enumerate()
            .map(|(i, ns)| (ns.clone(), i as NsId))
            .collect();
    }
}

/// Lower-tier ownership from KV events whose `medium` is not the device: blocks a worker rank
/// keeps in host memory or on disk. Reloading them beats a prefill, so a policy may prefer
/// such a rank, but they are never device ownership.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct LowerTiers {
    pub host: OwnerIndex,
    pub disk: OwnerIndex,
}

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
