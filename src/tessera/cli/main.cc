// The `tessera` command: parses flags and hands off to library functions.
#include <cstdio>

int main(int argc, char** argv) {
  std::puts("tessera");
  return 0;
}
