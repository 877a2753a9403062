//! Test support shared by unit and integration tests: fakes for the seams and in-process servers.
//! Compiled into the library (integration tests need it) but used by no production path.
pub mod apiserver;
pub mod gpu;
