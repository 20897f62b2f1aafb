//! What the examples share: command-line flags in the plainest form, so each example reads as
//! the library calls it makes.

/// `--name VALUE` from the command line, if given.
pub fn flag(name: &str) -> Option<String> {
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == name {
            return args.next();
        }
    }
    None
}

/// `--name N`, or `default`; a value that is not a whole number is an error naming the flag.
pub fn number(name: &str, default: u32) -> Result<u32, String> {
    match flag(name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| format!("{name} takes a whole number, not `{v}`")),
    }
}

/// Whether `--name` was given.
pub fn switch(name: &str) -> bool {
    std::env::args().skip(1).any(|a| a == name)
}

/// The process's exit for an example's `run()`: success, or the error printed with `error:`
/// (its message, not its debug form) and failure.
pub fn exit(result: Result<(), Box<dyn std::error::Error>>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
