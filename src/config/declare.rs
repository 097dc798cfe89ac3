//! The `settings!` macro: every `serve` setting declared once, in `config/mod.rs`.

/// Declares the `serve` settings once. A setting is one field: its doc comment is its
/// `--help` text, its `#[arg]` its flag, environment variable and default, its name its
/// key in the `--config` file. From the one list this generates:
///
/// - the clap structs: `ServeArgs` (its first field, `config`, ended by `;`, is the file's
///   own path and no setting) and the group of settings it flattens last (the secrets keys,
///   also flattened into `secrets reencrypt`, which reads no file);
/// - `FileConfig`: every setting as an optional key, unknown keys refused;
/// - `ServeArgs::take_file`: the file's value of every setting given neither on the
///   command line nor in the environment;
/// - for the tests, `ServeArgs::settings`: every setting with a way to read it back
///   (`tests::every_setting_is_reachable_from_the_command_line_the_environment_and_the_file`).
macro_rules! settings {
    (
        $(#[$serve_meta:meta])*
        pub struct $serve:ident {
            $(#[$config_meta:meta])*
            pub config: Option<PathBuf>;
            $( $(#[$meta:meta])* pub $field:ident: $ty:ty, )+
        }

        $(#[$group_meta:meta])*
        pub struct $group_ty:ident flattened as $group:ident {
            $( $(#[$group_field_meta:meta])* pub $group_field:ident: $group_field_ty:ty, )+
        }
    ) => {
        $(#[$serve_meta])*
        pub struct $serve {
            $(#[$config_meta])*
            pub config: Option<PathBuf>,
            $( $(#[$meta])* pub $field: $ty, )+
            #[doc = concat!("The settings declared with [`", stringify!($group_ty), "`].")]
            #[command(flatten)]
            pub $group: $group_ty,
        }

        $(#[$group_meta])*
        pub struct $group_ty {
            $( $(#[$group_field_meta])* pub $group_field: $group_field_ty, )+
        }

        /// The `--config` file: every setting's name is a key, every key optional; unknown
        /// keys are an error (typos must not pass).
        #[derive(Debug, Default, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        struct FileConfig {
            $( $field: Option<$ty>, )+
            $( $group_field: Option<$group_field_ty>, )+
        }

        impl $serve {
            /// Take the file's value of every setting for which `explicit` (given on the
            /// command line or in the environment) is false.
            fn take_file(&mut self, file: FileConfig, explicit: impl Fn(&str) -> bool) {
                $(
                    if let Some(value) = file.$field
                        && !explicit(stringify!($field))
                    {
                        self.$field = value;
                    }
                )+
                $(
                    if let Some(value) = file.$group_field
                        && !explicit(stringify!($group_field))
                    {
                        self.$group.$group_field = value;
                    }
                )+
            }

            /// Every setting, as the reachability test drives it.
            #[cfg(test)]
            fn settings() -> Vec<tests::Setting> {
                vec![
                    $( tests::Setting::new::<$ty>(stringify!($field), |s| format!("{:?}", s.$field)), )+
                    $(
                        tests::Setting::new::<$group_field_ty>(stringify!($group_field), |s| {
                            format!("{:?}", s.$group.$group_field)
                        }),
                    )+
                ]
            }
        }
    };
}
