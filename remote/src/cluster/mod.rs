//! A kvtide cluster: owners register in etcd (membership with leases), clients place keys on
//! them by rendezvous hashing. etcd is never on the data path: clients read the membership in
//! the background and talk to owners directly.
//!
//! `etcd` is the client of etcd's JSON gateway, `member` the records owners write, `placement`
//! the hashing, `registration` an owner's side, `store` the client (`ClusterStore`), `view` the membership
//! view it routes by (each member's health and connection).

pub mod etcd;
pub mod member;
pub mod placement;
pub mod registration;
pub mod store;
mod view;

pub use etcd::{Etcd, EtcdConfig, EtcdError};
pub use member::Member;
pub use registration::{ClusterConfig, ClusterError, Registration, RegistrationCounters, DEFAULT_LEASE_TTL_S};
pub use store::{ClusterOptions, ClusterStore, RoutingStats, MAX_REPLICATION};
