fn main() {
    eprintln!("spotguard: under construction");
}
