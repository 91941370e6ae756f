#!/bin/sh
echo "hello from the demo app"
