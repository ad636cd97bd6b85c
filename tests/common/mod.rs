pub mod nspawn;
