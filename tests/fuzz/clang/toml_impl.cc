// toml++'s implementation, compiled once with the fuzz flags so the TOML parser is
// instrumented too (the main build links Debian's libtomlplusplus.so instead).
#define TOML_IMPLEMENTATION
#include <toml++/toml.h>
