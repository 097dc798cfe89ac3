//! Rebuild when a migration is added or changed: `sqlx::migrate!` embeds `migrations/`
//! at compile time, and cargo does not otherwise look at that directory.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
