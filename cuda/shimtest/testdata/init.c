/* cuInit alone: prints its result's name. */
#include "check.h"

int main(void)
{
    printf("%s\n", errname(cuInit(0)));
    return 0;
}
